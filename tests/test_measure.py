"""Issue 4's instruments on real processes: the benchmark (profiler inside) over an emulated link,
the link probe, the namespace's clean-up, and refusals before anything starts."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from commsched.cluster import netns
from commsched.options import FusionOptions
from commsched.profile.probe import fit_line
from conftest import ended_with_an_error, run_worker

CAN_EMULATE = netns.unavailable_reason() is None
needs_netns = pytest.mark.skipif(not CAN_EMULATE, reason=str(netns.unavailable_reason()))


def run(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)


def quick_bench(tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The benchmark on 3 timed steps after 1 of warm-up, one round: its output and its CSV's rows."""
    proc = run("commsched.bench.cli", *overrides, "steps=3", "warmup=1", "rounds=1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, list(csv.DictReader((tmp_path / "bench.csv").open()))


def test_benchmark_runs_on_an_emulated_link_and_explains_itself(tmp_path):
    """CI runs as root: the 2-worker benchmark over a 200 Mbit namespace, tiny model, few steps."""
    proc, rows = quick_bench(tmp_path, "link.rate=200mbit", "width=8")
    assert [r["schedule"] for r in rows] == ["ddp", "wfbp", "dear"]
    assert {r["link_rate"] for r in rows} == {"200mbit" if CAN_EMULATE else "none"}
    if not CAN_EMULATE:
        assert "running on the unlimited loopback" in proc.stdout
    for row in rows:
        assert float(row["step_ms"]) > 0 and float(row["predicted_ms"]) > 0
        assert float(row["weights_vs_ddp"]) <= 1e-5  # same seed, same batches: the schedules change no math
        if row["schedule"] != "ddp":  # ddp is Lightning's, not ours to bound
            assert float(row["theoretical_ms"]) > 0
    assert "best possible" in proc.stdout and "simulated" in proc.stdout
    assert proc.stdout.count("GPU available") <= 1  # Lightning's banner once, not per phase
    assert (tmp_path / "bench.png").stat().st_size > 5000
    if CAN_EMULATE:
        assert netns.namespaces() == []

    # the profiler's output for the components (the plain wfbp run's own, on fixed buckets, which its
    # planner planned from), as the simulator and planners read it
    profile = json.loads((tmp_path / "small_cnn" / "profile.json").read_text())
    fusion = FusionOptions()
    assert profile["schedule"] == "wfbp" and profile["world_size"] == 2
    assert profile["profiled_steps"] == fusion.profile_warmup_steps + fusion.profile_steps
    layers = profile["workload"]["layers"]
    owners = [f"net.features.{i}.{j}" for i in (0, 2, 4, 5) for j in (0, 1)] + ["net.classifier.1", "net.classifier.3"]
    assert [l["name"] for l in layers] == owners  # forward order
    param_bytes = sum(l["nbytes"] for l in layers)
    assert sum(b["nbytes"] for b in profile["buckets"]) == param_bytes
    assert all(l["forward_s"] > 0 and l["backward_s"] >= 0 for l in layers)
    summary = profile["summary"]
    assert summary["t_ff"] == pytest.approx(sum(l["forward_s"] for l in layers))
    assert summary["t_ar"] > 0 and summary["t_rs"] > 0 and summary["t_ag"] > 0
    assert all(set(s) >= {"step_s", "exposed_comm_s", "overlap_ratio"} for s in profile["steps"])
    trace = json.loads((tmp_path / "small_cnn" / "trace.json").read_text())["traceEvents"]
    lanes = {(e["pid"], e["args"]["name"]) for e in trace if e.get("name") == "thread_name"}
    assert lanes == {(r, lane) for r in (0, 1) for lane in ("compute", "link: primary", "link: control")}
    assert any(e["ph"] == "X" and e["name"].startswith("all_reduce") for e in trace)


def test_the_weights_column_compares_with_ddp_under_the_same_learning_rate_schedule(tmp_path):
    """GPT-2's recipe decays its learning rate over the fit's length: the ddp reference must run a fit
    of the same length as every entry, or the column reports a difference the schedules did not make."""
    _, rows = quick_bench(tmp_path, "link.rate=none", "models=[gpt2_tiny]", "width=16", "schedules=[ddp,wfbp]")
    assert [r["schedule"] for r in rows] == ["ddp", "wfbp"]
    assert all(float(r["weights_vs_ddp"]) <= 1e-5 for r in rows), [r["weights_vs_ddp"] for r in rows]


def test_ranks_sharing_a_gpu_run_as_nodes_of_their_own_over_gloo(tmp_path, monkeypatch, capfd):
    """Where the ranks outnumber the GPUs (two ranks, one GPU), the benchmark runs each rank as a node of
    its own on the loopback, every entry (ddp too) over gloo. No GPU here: the same launch, with the
    ranks on the CPU, said to share; every row measured and exact."""
    import dataclasses

    from rich.console import Console

    from commsched.bench import report
    from commsched.bench.config import BenchConfig

    monkeypatch.setattr(report, "gpu_layout", lambda spec: "nodes")
    spec = {**dataclasses.asdict(BenchConfig()), "width": 8, "steps": 3, "warmup": 1, "rounds": 1}
    results, rate = report.run_benchmark(spec, tmp_path, Console())
    assert rate == "none" and "2 ranks, more than this machine's GPUs" in capfd.readouterr().out
    ran = json.loads((tmp_path / "bench.json").read_text())
    assert (ran["devices"], ran["num_nodes"], ran["backend"]) == (1, 2, "gloo")
    rows = results[0]["rows"]
    assert [r["schedule"] for r in rows] == ["ddp", "wfbp", "dear"]
    assert all(r["step_ms"] > 0 and r["weights_vs_ddp"] <= 1e-5 for r in rows), rows


def _bench_row(schedule: str, weights: float) -> dict:
    return {
        "schedule": schedule, "step_ms": 30.0, "cpu_ms": 30.0, "samples_per_s": 2000.0, "speedup_vs_ddp": 1.0,
        "median_speedup_vs_ddp": 1.0, "wire_mb": None, "local_mb": None, "theoretical_ms": None,
        "measured_over_theoretical": None, "predicted_ms": None, "prediction_error": None,
        "weights_vs_ddp": weights, "rounds_ms": [30.0, 30.0],
    }  # fmt: skip


def test_the_bench_shows_what_each_entry_spends_its_timed_steps_on(tmp_path):
    """`operator_profile=true`: each entry runs once more under torch.profiler, over exactly its timed
    steps (3 here: the optimizer stepped 3 times), and the table is the plain runs' alone."""
    proc, rows = quick_bench(tmp_path, "width=8", "schedules=[ddp,wfbp]", "operator_profile=true")
    assert [r["schedule"] for r in rows] == ["ddp", "wfbp"]
    for entry in ("ddp", "wfbp"):
        table = (tmp_path / "small_cnn" / "operators" / f"{entry}.txt").read_text()
        assert table.startswith("3 timed steps, rank 0")
        (step,) = [line for line in table.splitlines() if "Optimizer.step#SGD.step" in line]
        assert step.split()[-1] == "3", step
        assert (tmp_path / "small_cnn" / "operators" / f"{entry}.trace.json").stat().st_size > 1000


def test_where_layer_timing_distorts_a_step_the_totals_come_from_steps_timed_whole(tmp_path):
    """On a GPU every layer hook of the profiler waits for the device, which a launch-bound step pays
    for many times over: there steps timed layer by layer alternate with steps timed whole, and the
    forward and backward totals (which the layers are scaled to, and the bounds and planners read) are
    the whole steps' medians. Played on the CPU by naming it such a device (2 processes)."""
    steps = 4
    proc = run_worker("run_profile_apart.py", str(tmp_path), str(steps), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    warmup = profile["warmup_steps"]
    records = profile["steps"]
    assert profile["profiled_steps"] == len(records) == warmup + 2 * (steps - warmup)
    assert [r["layers_timed"] for r in records] == [k % 2 == 0 for k in range(len(records))]
    hooked = torch.load(tmp_path / "hooked.rank0.pt")
    assert hooked[: len(records)] == [r["layers_timed"] for r in records], "hooks on exactly the layer-timed steps"
    assert not any(hooked[len(records) :]), "no hook left once the profile finished"
    whole = [r for r in records[warmup:] if not r["layers_timed"]]
    summary = profile["summary"]
    for phase, total in (("forward_s", "t_ff"), ("backward_s", "t_bp")):
        values = sorted(r[phase] for r in whole)
        assert summary[total] == pytest.approx((values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2)
    layers = profile["workload"]["layers"]
    assert sum(layer["forward_s"] for layer in layers) == pytest.approx(summary["t_ff"])


def test_a_step_of_two_backwards_is_one_record_of_the_profile(tmp_path):
    """A GAN's step (two backwards, two optimizers) on a device timed layer by layer and whole by
    turns: each step's record holds both its backwards (the second sleeps, so every record's backward
    lasts at least that long), and the records alternate as the steps do."""
    proc = run_worker("run_profile_apart.py", str(tmp_path), "4", "gan", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    records = profile["steps"]
    assert [r["layers_timed"] for r in records] == [k % 2 == 0 for k in range(len(records))]
    slow = 0.03  # run_profile_apart.SLOW_BACKWARD_S
    assert all(r["backward_s"] >= slow for r in records), [r["backward_s"] for r in records]
    assert profile["summary"]["t_bp"] >= slow


@pytest.mark.parametrize("floor", [0.0, 3.2e-3])
def test_the_table_says_when_ddp_does_not_repeat_itself(floor):
    """On a GPU ddp's second run can differ from its first (kernels that sum in a varying order): the
    weights column is then read against that floor, and the table says so; where ddp repeats itself
    exactly it says nothing."""
    from rich.console import Console

    from commsched.bench.report import print_results

    result = {"model": "resnet18", "gradient_mb": 42.6, "buckets": 3, "components_ms": {"t_ff": 1.0}, "rows": [
        _bench_row("ddp", floor), _bench_row("dear", 5e-3)]}  # fmt: skip
    console = Console(record=True, width=400)
    print_results([result], {"devices": 2, "batch_size": 32}, "none", console)
    text = console.export_text()
    assert ("ddp differs from its own second run by 3.2e-03" in text) == bool(floor), text


@pytest.mark.parametrize(
    "override, field",
    [
        ("models=[alexnet]", "models=alexnet; allowed: one of 'small_cnn'"),
        ("schedules=[ddp,fast]", "schedules=fast"),
        ("link.rate=fast", "link.rate=fast"),
        ("devices=1", "devices=1"),
        ("schedules=[ddp,topk@2]", "allowed: topk@D with 0 < D <= 1"),
        ("schedules=[ddp,hier@0.1]", "a density after @ only for topk"),
        ("accelerator=tpu", "accelerator=tpu; allowed: one of 'cpu', 'gpu'"),
        pytest.param(
            "accelerator=gpu",
            "accelerator=gpu; allowed: cpu (this machine has no CUDA device)",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
        ),
    ],
)
def test_benchmark_refuses_bad_input_before_starting_workers(tmp_path, override, field):
    proc = run("commsched.bench.cli", override, f"hydra.run.dir={tmp_path}", timeout=120)
    ended_with_an_error(proc, status=2)
    assert field in proc.stderr + proc.stdout
    assert "Initializing distributed" not in proc.stderr + proc.stdout


@needs_netns
def test_probe_measures_the_emulated_rate(tmp_path):
    """100 Mbit shared by both directions of the loopback: an all-gather on 2 workers moves the
    whole buffer through it once, so its fitted bandwidth must be close to 12.5 MB/s."""
    out = tmp_path / "probe.json"
    proc = run(
        "commsched.profile.cli", "--rate", "100mbit", "--sizes", "64k,256k,1m", "--repeats", "2", "--out", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    link = json.loads(out.read_text())["link"]
    assert link["workers"] == 2
    assert 0.6 * 12.5e6 < 1 / link["all_gather"]["b"] < 1.4 * 12.5e6
    assert "all_reduce" in proc.stdout and "latency" in proc.stdout
    assert netns.namespaces() == []


def test_probe_refuses_bad_sizes():
    proc = run("commsched.profile.cli", "--sizes", "4k", timeout=60)
    assert proc.returncode == 2 and "--sizes" in proc.stderr


def test_fit_line_recovers_alpha_and_beta():
    sizes = [1e3, 1e4, 1e5, 1e6]
    line = fit_line(sizes, [2e-4 + 3e-9 * m for m in sizes])
    assert line.a == pytest.approx(2e-4, rel=1e-6) and line.b == pytest.approx(3e-9, rel=1e-6)
    assert line.residual == pytest.approx(0.0, abs=1e-9)


@needs_netns
def test_namespace_is_removed_when_the_command_fails():
    assert netns.run_in_namespace("10mbit", [sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert netns.namespaces() == []


@needs_netns
def test_namespace_is_removed_when_the_run_is_terminated():
    script = (
        "import sys; from commsched.cluster import netns; "
        "netns.run_in_namespace('10mbit', [sys.executable, '-c', 'import time; time.sleep(60)'])"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while not netns.namespaces() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert netns.namespaces(), "the namespace never appeared"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert netns.namespaces() == []


def test_without_root_the_namespace_is_refused_with_the_reason(tmp_path):
    """Run as an unprivileged user (nobody) when we are root, so this path is exercised on CI too."""
    code = (
        "from commsched.cluster import netns\n"
        "try:\n    netns.run_in_namespace('1gbit', ['true'])\n"
        "except PermissionError as error:\n    print('refused:', error)\n"
    )
    command = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MPLCONFIGDIR": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert "refused: emulating a slow link needs root" in proc.stdout, proc.stderr[-2000:]
