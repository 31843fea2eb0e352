"""The simulator's invariants (issue 4): limits that must hold for any workload and network."""

from __future__ import annotations

import csv
import random

import pytest

from commsched.errors import CommSchedConfigError
from commsched.sim import SIM_SCHEDULES, AlphaBeta, Fitted, Layer, Line, Workload, builtin, cli, simulate, timelines

BUILTINS = {name: builtin(name) for name in ("resnet50", "vgg16", "gpt2")}
RING_10G = AlphaBeta.from_rate(10e9, 50e-6)


def random_workload(rng: random.Random, backward_over_forward: tuple[float, float] = (0.5, 2.0)) -> Workload:
    layers = []
    for i in range(rng.randint(1, 12)):
        forward = rng.uniform(0, 0.01)
        nbytes = rng.choice([0, rng.randint(1, 10**7)])
        layers.append(Layer(f"l{i}", nbytes, forward, forward * rng.uniform(*backward_over_forward)))
    if not layers[0].nbytes:  # as in every real model: the input layer has weights
        layers[0] = Layer("l0", 1000, layers[0].forward_s, layers[0].backward_s)
    return Workload("random", tuple(layers), 1)


def random_network(rng: random.Random) -> AlphaBeta:
    return AlphaBeta(rng.uniform(0, 1e-3), rng.uniform(0, 1e-8), rng.choice(["ring", "tree"]))


def random_buckets(rng: random.Random, workload: Workload) -> list[list[int]]:
    singles = timelines.per_layer(workload)
    cuts = sorted(rng.sample(range(1, len(singles)), rng.randint(0, len(singles) - 1))) if len(singles) > 1 else []
    return [sum(singles[a:b], []) for a, b in zip([0, *cuts], [*cuts, len(singles)])]


def uniform_workload(layers: int, t_ff: float, t_bp: float, nbytes: float) -> Workload:
    return Workload(
        "uniform", tuple(Layer(f"l{i}", int(nbytes / layers), t_ff / layers, t_bp / layers) for i in range(layers)), 1
    )


@pytest.mark.parametrize("name", SIM_SCHEDULES)
@pytest.mark.parametrize("workers", [2, 64, 2048])
def test_infinite_bandwidth_is_pure_compute(name: str, workers: int) -> None:
    free = AlphaBeta(0.0, 0.0)
    for workload in BUILTINS.values():
        result = simulate(name, workload, free, workers)
        assert result.iteration_s == pytest.approx(workload.forward_s + workload.backward_s, rel=1e-9)
        assert result.speedup(workload, workers) == pytest.approx(workers)


def test_wfbp_with_one_bucket_equals_sync_easgd() -> None:
    rng = random.Random(0)
    cases = [(w, RING_10G, p) for w in BUILTINS.values() for p in (2, 16, 2048)]
    cases += [(random_workload(rng), random_network(rng), rng.choice([2, 3, 8, 512])) for _ in range(200)]
    for workload, network, workers in cases:
        everything = [sum(timelines.per_layer(workload), [])]
        one_bucket = timelines.wfbp(workload, network, workers, everything).iteration_s
        assert one_bucket == pytest.approx(timelines.sync_easgd(workload, network, workers).iteration_s, rel=1e-12)


def test_dear_never_slower_than_wfbp_with_the_same_buckets() -> None:
    """Holds whenever no layer's backward takes more than twice its forward (the papers' t_bp = 2 t_ff)."""
    rng = random.Random(1)
    for _ in range(400):
        workload, network, workers = random_workload(rng), random_network(rng), rng.choice([2, 3, 4, 16, 128])
        buckets = random_buckets(rng, workload)
        dear = timelines.dear(workload, network, workers, buckets).iteration_s
        assert dear <= timelines.wfbp(workload, network, workers, buckets).iteration_s * (1 + 1e-12)
    for workload in BUILTINS.values():
        for buckets in (timelines.per_layer(workload), timelines.fixed_size(workload, 25 * 2**20)):
            for workers in (2, 64, 2048):
                dear = timelines.dear(workload, RING_10G, workers, buckets).iteration_s
                assert dear <= timelines.wfbp(workload, RING_10G, workers, buckets).iteration_s * (1 + 1e-12)


def test_dear_can_lose_when_a_layer_backward_exceeds_twice_its_forward() -> None:
    """Why the invariant above needs its condition: the last layer's all-reduce (2 s) hides under the
    first layer's 2 s backward in WFBP, but its all-gather (1 s) is longer than the 0.1 s forward of
    the first layer that DeAR can overlap it with."""
    workload = Workload("edge", (Layer("first", 1, 0.1, 2.0), Layer("last", 2 * 10**9, 0.0, 0.0)), 1)
    network = AlphaBeta(0.0, 1e-9)  # ring, 2 workers: reduce-scatter = all-gather = 1 s, all-reduce 2 s
    buckets = [[1], [0]]
    assert timelines.wfbp(workload, network, 2, buckets).iteration_s == pytest.approx(0.1 + 2.0 + 0.0)
    assert timelines.dear(workload, network, 2, buckets).iteration_s == pytest.approx(1.0 + 2.0)


def test_ring_costs_are_dear_equations_3_to_5() -> None:
    alpha, beta, m = 1e-5, 1e-9, 8e6
    for p in (2, 3, 16, 2048):
        ring = AlphaBeta(alpha, beta, "ring")
        assert ring.time("reduce_scatter", m, p) == pytest.approx((p - 1) * (alpha + m / p * beta))
        assert ring.time("all_gather", m, p) == pytest.approx((p - 1) * (alpha + m / p * beta))
        assert ring.time("all_reduce", m, p) == pytest.approx(2 * (p - 1) * alpha + 2 * (p - 1) * m / p * beta)
    assert AlphaBeta(alpha, beta, "tree").time("all_reduce", m, 1024) == pytest.approx(2 * 10 * alpha + 2 * m * beta)


@pytest.mark.parametrize("t_ag_over_t_ff", [0.5, 1.0, 1.5, 2.0, 3.0])
def test_fine_grained_limits_reproduce_dear_equations_7_to_9(t_ag_over_t_ff: float) -> None:
    """Many small layers, no latency: both schedules approach their perfect-overlap bounds, and their
    difference is Eq. 9 under t_ar = 2 t_rs = 2 t_ag and t_bp = 2 t_ff."""
    t_ff, layers = 0.1, 2000
    t_ag = t_ag_over_t_ff * t_ff
    network = AlphaBeta(0.0, t_ag / 1e9 * 2)  # 2 workers: all-gather of 1e9 bytes = m/2 * beta
    workload = uniform_workload(layers, t_ff, 2 * t_ff, 1e9)
    t_rs, t_ar = t_ag, 2 * t_ag
    eq7 = max(t_ff, t_ag) + max(2 * t_ff, t_rs)
    eq8 = t_ff + max(2 * t_ff, t_ar)
    eq9 = 0.0 if t_ag <= t_ff else (t_ag - t_ff if t_ag <= 2 * t_ff else t_ff)
    tolerance = 3 * (t_ff + t_ag) / layers * 2
    dear = timelines.dear(workload, network, 2).iteration_s
    wfbp = timelines.wfbp(workload, network, 2).iteration_s
    assert dear == pytest.approx(eq7, abs=tolerance)
    assert wfbp == pytest.approx(eq8, abs=tolerance)
    assert wfbp - dear == pytest.approx(eq9, abs=2 * tolerance)


def test_no_schedule_beats_the_maximum_speedup_of_dear_equation_6() -> None:
    """Eq. 6 bounds schedules that overlap communication only within an iteration's backward (and,
    for DeAR, forward). ByteScheduler overlaps across iterations, so it is held only to the bound
    every schedule obeys: compute and link are each busy for their totals every iteration."""
    for workload in BUILTINS.values():
        for workers in (2, 16, 256):
            t_ff, t_bp, m = workload.forward_s, workload.backward_s, workload.nbytes
            bandwidth_only = AlphaBeta(0.0, RING_10G.beta)  # Eq. 6 counts bandwidth, not latency
            t_rs = bandwidth_only.time("reduce_scatter", m, workers)
            t_ag, t_ar = bandwidth_only.time("all_gather", m, workers), bandwidth_only.time("all_reduce", m, workers)
            s_max = workers * (t_ff + t_bp) / (t_ff + t_bp + t_ar - min(t_rs, t_bp) - min(t_ag, t_ff))
            s_busy = workers * (t_ff + t_bp) / max(t_ff + t_bp, t_ar)
            for name in SIM_SCHEDULES:
                speedup = simulate(name, workload, bandwidth_only, workers).speedup(workload, workers)
                if name == "deft":  # sums iterations into fewer all-reduces: held only to compute
                    assert speedup <= workers * (1 + 1e-9)
                    continue
                assert speedup <= (s_busy if name == "bytescheduler" else s_max) * (1 + 1e-9)


def test_mgwfbp_never_worse_than_wfbp_or_sync_easgd() -> None:
    rng = random.Random(2)
    for _ in range(300):
        workload, network = random_workload(rng, (0.0, 4.0)), random_network(rng)
        workers = rng.choice([2, 4, 128, 2048])
        merged = timelines.mgwfbp(workload, network, workers).iteration_s
        assert merged <= timelines.wfbp(workload, network, workers).iteration_s + 1e-12
        assert merged <= timelines.sync_easgd(workload, network, workers).iteration_s + 1e-12


def test_bytescheduler_lets_the_first_layer_jump_the_queue() -> None:
    """The output layer's 4 GB gradient goes in 1 GB partitions; the input layer's, ready a second
    later, is sent next, so the next forward starts before the output layer's is all through.
    WFBP sends them in order and waits for both."""
    workload = Workload("two", (Layer("input", 10**9, 0.5, 1.0), Layer("output", 4 * 10**9, 0.5, 1.0)), 1)
    network = AlphaBeta(0.0, 1e-9)  # ring on 2 workers: 1 s per GB all-reduced
    assert timelines.wfbp(workload, network, 2).iteration_s == pytest.approx(7.0)
    assert simulate("bytescheduler", workload, network, 2, partition_bytes=1e9).iteration_s == pytest.approx(6.5)


def test_fitted_costs_refuse_other_world_sizes() -> None:
    fitted = Fitted(2, {"all_reduce": Line(1e-4, 1e-9)})
    assert fitted.time("all_reduce", 1e6, 2) == pytest.approx(1e-4 + 1e-3)
    with pytest.raises(ValueError, match="probed with 2 workers"):
        fitted.time("all_reduce", 1e6, 4)
    assert Fitted.from_dict(fitted.to_dict()) == fitted


def test_builtin_workloads_match_the_zoo() -> None:
    assert BUILTINS["resnet50"].nbytes == 25_557_032 * 4
    assert BUILTINS["vgg16"].nbytes == 138_357_544 * 4
    assert BUILTINS["gpt2"].backward_s == pytest.approx(2 * BUILTINS["gpt2"].forward_s)
    with pytest.raises(CommSchedConfigError, match="workload"):
        builtin("alexnet")


def test_cli_writes_table_csv_plot_and_traces(tmp_path, capsys) -> None:
    cli.main(["--workload", "resnet50", "--workers", "2,64", "--schedules", "wfbp,dear", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "resnet50" in printed and "dear" in printed
    rows = list(csv.DictReader((tmp_path / "simulate.csv").open()))
    assert [(r["workers"], r["schedule"]) for r in rows] == [
        ("2", "wfbp"),
        ("2", "dear"),
        ("64", "wfbp"),
        ("64", "dear"),
    ]
    assert (tmp_path / "speedup.png").stat().st_size > 0
    assert (tmp_path / "trace_dear_P2.json").stat().st_size > 0


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--schedules", "wfbp,fast"], "--schedules"),
        (["--workers", "2,zero"], "--workers"),
        (["--workload", "alexnet"], "--workload"),
        (["--bandwidth", "fast"], "rate"),
    ],
)
def test_cli_bad_input_names_the_field(argv: list[str], field: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert field in capsys.readouterr().err


def test_measured_costs_are_exact_at_their_points_and_linear_between() -> None:
    from commsched.sim import Measured

    measured = Measured(2, {"all_reduce": ((1e6, 0.010), (4e6, 0.025), (2e6, 0.016))})
    assert measured.time("all_reduce", 2e6, 2) == pytest.approx(0.016)
    assert measured.time("all_reduce", 3e6, 2) == pytest.approx(0.0205)
    assert measured.time("all_reduce", 8e6, 2) == pytest.approx(0.025 + 4e6 * 0.009 / 2e6)  # last segment extended
    with pytest.raises(ValueError, match="measured with 2 workers"):
        measured.time("all_reduce", 1e6, 4)


def test_measured_costs_never_fall_with_size() -> None:
    """Noisy small timings (1 KB slower than 64 KB) are lowered to what a larger message cost."""
    from commsched.sim import Measured

    measured = Measured(2, {"all_gather": ((1024, 2.7e-3), (65536, 0.5e-3), (1 << 20, 9e-3))})
    assert measured.time("all_gather", 1024, 2) == pytest.approx(0.5e-3)
    sizes = [2**k for k in range(10, 21)]
    times = [measured.time("all_gather", m, 2) for m in sizes]
    assert times == sorted(times)


def test_deft_hides_a_slow_link_by_delaying_and_uses_both_links() -> None:
    from commsched.sim.deft_timeline import deft

    workload = builtin("vgg16")
    slow = AlphaBeta(50e-6, 8 / 1e9)  # 1 Gbit/s
    result = deft(workload, slow, 8, mu=1.65)
    wfbp = simulate("wfbp", workload, slow, 8)
    assert result.iteration_s < wfbp.iteration_s
    assert max(result.plan.k) > 1  # generations summed: fewer, larger updates
    assert {span.lane for span in result.spans} >= {"compute", "link: primary", "link: secondary"}
    fast = deft(workload, AlphaBeta(0.0, 0.0), 8)
    assert fast.plan.k == (1,) and fast.iteration_s == pytest.approx(workload.forward_s + workload.backward_s)


def test_compressed_exchanges_match_their_closed_forms():
    """One 4 MB bucket ready at the end of a 10 ms backward: the exchange's cost in closed form."""
    from commsched.sim.compressed import sent_bytes

    work = Workload("one", (Layer("only", 4_000_000, 0.005, 0.010),), batch_size=1)
    inter, intra = AlphaBeta(alpha=1e-4, beta=1e-8), AlphaBeta(alpha=1e-6, beta=1e-10)
    k = 10_000  # density 0.01 of 1 M floats
    assert sent_bytes(4_000_000, 0.01) == 8 * k
    topk = simulate("topk", work, inter, 16, density=0.01)
    assert topk.iteration_s == pytest.approx(0.015 + 15 * (1e-4 + 8 * k * 1e-8))
    # 4 nodes x 4: intra RS + AG of 4 MB among 4, all-gather of a quarter's k among 4 nodes
    halves = 2 * 3 * (1e-6 + 1_000_000 * 1e-10)
    hitopk = simulate("hitopk", work, inter, 16, density=0.01, per_node=4, intra=intra)
    assert hitopk.iteration_s == pytest.approx(0.015 + halves + 3 * (1e-4 + 8 * (k // 4) * 1e-8))
    dense = simulate("hier_dense", work, inter, 16, per_node=4, intra=intra)
    assert dense.iteration_s == pytest.approx(0.015 + halves + 2 * 3 * (1e-4 + 1_000_000 / 4 * 1e-8))
    assert hitopk.iteration_s < dense.iteration_s < simulate("wfbp", work, inter, 16).iteration_s


def test_the_simulator_counts_the_one_dimensional_values_sent_whole():
    """A 4 MB layer of which 40 KB are biases and norms: k counts the rest, and the 40 KB go as values."""
    from commsched.sim.compressed import sent_bytes
    from commsched.sim.workload import builtin

    k = 9_900  # density 0.01 of the 990,000 other floats
    assert sent_bytes(4_000_000, 0.01, 40_000) == 8 * k + 40_000
    work = Workload("one", (Layer("only", 4_000_000, 0.005, 0.010, 40_000),), batch_size=1)
    inter = AlphaBeta(alpha=1e-4, beta=1e-8)
    assert simulate("topk", work, inter, 16, density=0.01).iteration_s == pytest.approx(
        0.015 + 15 * (1e-4 + (8 * k + 40_000) * 1e-8)
    )
    resnet = builtin("resnet50")
    whole = sum(layer.whole_nbytes for layer in resnet.layers)
    assert 0.001 < whole / resnet.nbytes < 0.01  # ResNet-50: 0.2% of its elements are one-dimensional
    assert Workload.from_dict(resnet.to_dict()) == resnet


def test_simulate_cli_takes_the_compression_options(capsys):
    cli.main(
        [
            "--workload",
            "vgg16",
            "--schedules",
            "wfbp,topk,hitopk,hier_dense",
            "--workers",
            "16,2048",
            "--density",
            "0.001",
            "--gpus-per-node",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert "hitopk" in out and "2048" in out
    with pytest.raises(SystemExit):
        cli.main(["--schedules", "topk", "--density", "2"])


def test_a_16_bit_wire_sends_half_the_bytes_and_the_bound_follows() -> None:
    """`--comm-dtype bf16`: every layer's gradients cost half the bytes; a link-bound run's iteration
    falls by the communication's half (closed form: one bucket, after backward), compute unchanged."""
    layers = tuple(Layer(f"l{i}", 4_000_000, 0.01, 0.02, 4_000) for i in range(4))
    fp32 = Workload("w", layers, 32)
    bf16 = fp32.sent_as(2)
    assert bf16.nbytes == fp32.nbytes // 2 and bf16.forward_s == fp32.forward_s
    assert all(l.whole_nbytes == 2_000 for l in bf16.layers)
    network = AlphaBeta(alpha=0.0, beta=1e-9)  # 1 ns a byte
    one_bucket = [list(range(4))[::-1]]
    slow, fast = (timelines.wfbp(w, network, 2, one_bucket).iteration_s for w in (fp32, bf16))
    comm = 2 * (2 - 1) / 2 * fp32.nbytes * 1e-9  # a ring all-reduce of every byte
    assert slow == pytest.approx(fp32.forward_s + fp32.backward_s + comm)
    assert fast == pytest.approx(fp32.forward_s + fp32.backward_s + comm / 2)
