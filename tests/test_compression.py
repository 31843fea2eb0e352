"""Sparse exchanges: wfbp with top-k against a single-process reference of the exchange (every rank's
selection, residual and the sum of what was sent), written apart from the engine; flat and two-level."""

from __future__ import annotations

import math
import re

import pytest
import torch

from compression_reference import flat_residual, hierarchical_reference, needs_root, reference
from conftest import max_abs_diff, per_link


@pytest.mark.parametrize("case", ["topk", "topk-no-feedback", "topk-dense-phases", "topk-every-element"])
def test_topk_exchange_equals_the_single_process_reference(runs, case):
    result, other = runs(case), runs(case, 1)
    expected, residuals = reference(result)
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{case}: {diff} at {key}"
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert per_link(result["trace"]) == per_link(other["trace"])
    ops = [op for link, op, tag, numel, dtype in result["trace"] if tag.startswith("bucket")]
    expected_ops = (
        ["all_reduce"] * 3 + ["all_gather"] * 6 + ["all_reduce"] * 3
        if case == "topk-dense-phases"
        else ["all_gather"] * 12
    )
    assert ops == expected_ops
    if case == "topk-dense-phases":  # the residual joined the first dense step: nothing is left at the end
        assert all(t.abs().sum() == 0 for t in result["residuals"].values())
    if case == "topk":
        names = [n for n, _ in torch.nn.Module.named_parameters(__import__("run_deft").MLP("sgd"))]
        for rank, run in enumerate((result, other)):
            assert torch.allclose(flat_residual(run, names), residuals[rank], atol=1e-6)
            assert flat_residual(run, names).abs().sum() > 0
    if case == "topk-no-feedback":
        assert result["residuals"] == {}


def test_error_feedback_changes_the_result(runs):
    assert max_abs_diff(runs("topk")["state"], runs("topk-no-feedback")["state"])[0] > 1e-4


def test_a_sparse_run_without_warm_up_is_advised_once(runs):
    """The fifteen fresh sparse runs with no warm-up of either kind (12, 16 or 5 steps, shorter than their
    epoch of 256 samples / 2 ranks / batch 4 = 32 steps) are told a tenth of the run; the resumed, dense,
    warmed-up and density-1 runs are not."""
    advice = re.findall(r"no dense warm-up.*?CompressionOptions\(dense_warmup_steps=(\d+)\) \((.*?)\)", runs.said)
    assert advice == [("1", "a tenth of this run, shorter than an epoch")] * 15, (
        advice
    )  # and the dgc and adamw runs without warm-up


def test_the_warm_up_advice_is_one_epoch_or_a_tenth_of_a_shorter_run():
    from commsched import errors
    from commsched.schedules.wfbp import warm_up_advice

    assert warm_up_advice(32, 264) == "CompressionOptions(dense_warmup_steps=32) (one epoch here)"
    assert (
        warm_up_advice(32, 12)
        == "CompressionOptions(dense_warmup_steps=1) (a tenth of this run, shorter than an epoch)"
    )
    assert warm_up_advice(math.inf, math.inf) == "a dense warm-up (compression.dense_warmup_steps) of about one epoch"
    errors.use_syntax("hydra")  # commsched-train's workers: the command line's spelling
    try:
        assert (
            warm_up_advice(math.inf, 500)
            == "compression.dense_warmup_steps=50 (a tenth of this run, shorter than an epoch)"
        )
    finally:
        errors.use_syntax("python")


def test_density_one_equals_a_dense_all_reduce(runs):
    assert max_abs_diff(runs("mstopk-whole")["state"], runs("dense")["state"])[0] <= 1e-6


def test_mstopk_keeps_ranks_identical_and_sends_k_per_rank(runs):
    result, other = runs("mstopk"), runs("mstopk", 1)
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    assert max_abs_diff(result["state"], result["initial"])[0] > 1e-3  # it trained
    vectors = sum(v.numel() for v in result["initial"].values() if v.dim() == 1)
    k = math.ceil(0.05 * sum(v.numel() for v in result["initial"].values() if v.dim() > 1))
    sent = {numel_ for link, op, tag, numel_, dtype in result["trace"] if tag.startswith("bucket")}
    assert sent == {
        2 * (2 * k + vectors)
    }  # 2 ranks x (k values + k indices + the 1-d parameters' values, positions known)


def test_resumed_run_with_residuals_equals_uninterrupted(runs):
    for rank in (0, 1):
        whole, resumed = runs("topk", rank), runs("topk-resumed", rank)
        assert max_abs_diff(whole["state"], resumed["state"])[0] == 0.0
        assert set(whole["residuals"]) == set(resumed["residuals"])
        for name in whole["residuals"]:
            assert torch.equal(whole["residuals"][name], resumed["residuals"][name])


def test_a_dense_run_resumed_from_a_compressed_one_applies_its_residuals(runs):
    """Steps 0-4 top-k with error feedback, then dense from the checkpoint: what the ranks still owed
    joins step 5's gradient, as the reference's dense phase does."""
    resumed = runs("dense-from-topk")
    assert "refused" not in resumed
    expected, _ = reference(
        {**resumed, "compression": {"density": 0.1, "error_feedback": True, "dense_final_steps": 7}}
    )
    assert max_abs_diff(expected, resumed["state"])[0] <= 1e-5
    dropped, _ = reference(
        {**resumed, "compression": {"density": 0.1, "error_feedback": False, "dense_final_steps": 7}}
    )
    assert max_abs_diff(dropped, resumed["state"])[0] > 1e-4  # the residuals mattered
    assert "residuals join the first step's gradient" in runs.said


def test_a_resume_at_another_world_size_keeps_the_residuals_sum(runs):
    """Written by 2 processes, resumed by 3 (no step taken): each new rank holds a third of the sum."""
    parts = [runs("topk-part", rank)["residuals"] for rank in (0, 1)]
    now = [runs("topk-resharded", rank)["residuals"] for rank in (0, 1, 2)]
    assert set(now[0]) == set(parts[0])
    for name in parts[0]:
        owed = parts[0][name] + parts[1][name]
        assert (owed.abs().sum() > 0) == (owed.dim() > 1)  # 1-d parameters are sent whole: nothing owed
        assert torch.allclose(now[0][name] + now[1][name] + now[2][name], owed, atol=1e-6)
        assert torch.allclose(now[2][name], owed / 3, atol=1e-7)
    assert "re-sharded over 3" in runs.said


@needs_root
def test_the_step_timer_tells_node_local_bytes_from_the_rest(two_nodes):
    """The dense two-level all-reduce of a B-byte bucket on 2 nodes x 2: inside the node a ring
    reduce-scatter and all-gather each send B / 2 (node-local: B); across nodes the all-reduce of the
    B / 2 shard between 2 sends B / 2, beside a few values of the step's own bookkeeping (which
    parameters got gradients). The flat all-reduce has no node-local link."""
    _, padded, _ = two_nodes("hier-dense")["layout"]
    bucket = 4 * padded
    for rank in range(4):
        hier, flat = two_nodes("hier-dense", rank), two_nodes("flat-dense", rank)
        assert hier["local_bytes"] and set(hier["local_bytes"]) == {bucket}
        assert all(bucket / 2 <= wire - bucket <= bucket / 2 + 64 for wire in hier["wire_bytes"])
        assert set(flat["local_bytes"]) == {0.0} and flat["wire_bytes"][0] > 0


@needs_root
def test_the_dense_two_level_all_reduce_equals_the_flat_one(two_nodes):
    for rank in range(4):
        assert max_abs_diff(two_nodes("hier-dense", rank)["state"], two_nodes("flat-dense", rank)["state"])[0] <= 1e-5
    ops = {(link, op) for link, op, tag, *_ in two_nodes("hier-dense")["trace"] if tag.startswith("bucket")}
    assert ops == {("intra", "reduce_scatter"), ("inter", "all_reduce"), ("intra", "all_gather")}


@needs_root
@pytest.mark.parametrize("case", ["hier-topk", "hier-topk-phases"])
def test_hitopkcomm_equals_the_single_process_reference(two_nodes, case):
    result = two_nodes(case)
    expected, residuals = hierarchical_reference(result)
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    names, padded, _ = result["layout"]
    for rank in range(4):
        mine = two_nodes(case, rank)
        assert max_abs_diff(mine["state"], result["state"])[0] == 0.0
        # "inter" is one group per local rank: equal within it; the shards' 1-d elements differ between them
        assert per_link(mine["trace"]) == per_link(two_nodes(case, rank % 2)["trace"])
        assert {link: [r[:3] for r in records] for link, records in per_link(mine["trace"]).items()} == {
            link: [r[:3] for r in records] for link, records in per_link(result["trace"]).items()
        }
        whole = torch.zeros(padded)
        whole[: sum(mine["residuals"][n].numel() for n in names)] = torch.cat(
            [mine["residuals"][n].reshape(-1) for n in names]
        )
        local = rank % 2
        assert torch.allclose(whole.view(2, -1)[local], residuals[rank], atol=1e-6)
        assert whole.view(2, -1)[1 - local].abs().sum() == 0  # a rank keeps the residual of its own shard only
    across = [op for link, op, tag, *_ in result["trace"] if tag.startswith("bucket") and link == "inter"]
    assert across == (
        ["all_reduce"] * 2 + ["all_gather"] * 5 + ["all_reduce"] * 3
        if case == "hier-topk-phases"
        else ["all_gather"] * 10
    )


@needs_root
def test_hierarchical_mstopk_keeps_every_rank_identical(two_nodes):
    first = two_nodes("hier-mstopk")
    assert max_abs_diff(first["state"], first["initial"])[0] > 1e-3
    for rank in range(1, 4):
        assert max_abs_diff(two_nodes("hier-mstopk", rank)["state"], first["state"])[0] == 0.0


@needs_root
def test_two_levels_on_several_streams_and_their_search_equal_the_flat_all_reduce(two_nodes):
    """2 nodes x 2 workers: node first on 2 streams (each unit on its stream's intra and inter groups),
    and `streams="auto"` trying flat and node first, give the flat all-reduce's weights on every rank."""
    for case in ("hier-dense-streams", "auto-two-level"):
        for rank in range(4):
            assert max_abs_diff(two_nodes(case, rank)["state"], two_nodes("flat-dense", rank)["state"])[0] <= 1e-5, (
                case,
                rank,
            )
            assert per_link(two_nodes(case, rank)["trace"]) == per_link(two_nodes(case, 0)["trace"]), (case, rank)
    links = {link for link, *_ in two_nodes("hier-dense-streams")["trace"]}
    assert {"intra", "intra.1", "inter", "inter.1"} <= links
    trials = two_nodes("auto-two-level")["trials"]
    assert {t["hierarchical"] for t in trials} == {False, True} and trials[0]["streams"] == trials[1]["streams"] == 1
    assert len({str(two_nodes("auto-two-level", rank)["chosen"]) for rank in range(4)}) == 1


def test_topk_by_default_takes_turns_with_dense_and_keeps_the_faster_exactly(runs):
    """strategy="topk"'s default (method "auto"): after 5 steps, dense and sparse exchanges take turns
    (2 rounds of a switch step and a timed one each), then the faster is kept on every rank alike. Which
    is faster is the machine's to say; the arithmetic is not: the run equals the single-process reference
    exchanging dense on exactly the steps it did, each rank's residual joining the first dense step."""
    result, other = runs("topk-auto"), runs("topk-auto", 1)
    assert result["selection"]["method"] == "topk"  # torch.topk, ~10x faster than MSTopK on every CPU measured
    ops = [op for link, op, tag, numel, dtype in result["trace"] if tag.startswith("bucket")]
    assert len(ops) == 16 and set(ops) <= {"all_reduce", "all_gather"}
    turns = ["all_reduce"] * 2 + ["all_gather"] * 2
    assert ops[:5] == ["all_gather"] * 5 and ops[5:13] == turns * 2, ops
    assert ops[13:] == ["all_gather" if result["kept"] else "all_reduce"] * 3
    assert other["kept"] == result["kept"] and per_link(result["trace"]) == per_link(other["trace"])
    expected, _ = reference(result, dense_steps={t for t, op in enumerate(ops) if op == "all_reduce"})
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0


def test_steps_fp16s_scaler_skips_leave_residuals_and_velocities_as_they_were(runs):
    """Under a GradScaler the sparse exchange runs on unscaled gradients, and a step with an inf on any rank
    (skipped by the scaler, as Lightning's precision plugin skips it under ddp) leaves the weights, the
    residuals and DGC's velocities as before it: three overflowing steps change nothing."""
    for rank in (0, 1):
        skipped = runs("fp16-all-skipped", rank)
        assert skipped["scale"] == 2.0**40 / 2**3  # halved once per skipped step
        assert max_abs_diff(skipped["state"], skipped["initial"])[0] == 0.0
        kept = [*skipped["residuals"].values(), *skipped["velocities"].values()]
        assert kept and all(t.abs().sum() == 0 for t in kept), "a skipped step's gradient stayed in the state"
    some = [runs("fp16-some-skipped", rank) for rank in (0, 1)]
    assert 2.0**22 > some[0]["scale"] == some[1]["scale"]  # steps were skipped, then steps were taken
    assert max_abs_diff(some[0]["state"], some[0]["initial"])[0] > 0
    assert max_abs_diff(some[0]["state"], some[1]["state"])[0] == 0.0
    for run in some:
        kept = [*run["residuals"].values(), *run["velocities"].values()]
        assert all(torch.isfinite(t).all() for t in kept) and any(t.abs().sum() > 0 for t in kept)
