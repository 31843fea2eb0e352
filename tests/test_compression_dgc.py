"""DGC's corrections (momentum correction, decay first, masking, the warm-up) against a single-process
reference, flat and two-level; resumes and refusals."""

from __future__ import annotations

import re

import pytest
import torch

from compression_reference import dgc_reference, flat_state, hierarchical_dgc_reference, needs_root
from conftest import max_abs_diff


@pytest.mark.parametrize("case", ["dgc", "dgc-nesterov", "dgc-clipped", "dgc-masked", "dgc-warmup"])
def test_dgc_corrections_equal_the_single_process_reference(runs, case):
    """Momentum correction, masking, weight decay before accumulation, local clipping and the density's
    warm-up, under two param groups with their own momentum and decay: the 2-process run equals the
    reference written from DGC's description, weights, residuals and velocities of both ranks."""
    result, other = runs(case), runs(case, 1)
    densities = [1.0] * 4 + [0.25] * 4 + [0.1] * 4 if case == "dgc-warmup" else None
    expected, residuals, velocities = dgc_reference(result, densities, masking=case == "dgc-masked")
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{case}: {diff} at {key}"
    assert max_abs_diff(result["state"], other["state"])[0] == 0.0
    for rank, run in enumerate((result, other)):
        assert torch.allclose(flat_state(run, "residuals"), residuals[rank], atol=1e-6), rank
        assert torch.allclose(flat_state(run, "velocities"), velocities[rank], atol=1e-6), rank
        assert flat_state(run, "velocities").abs().sum() > 0
    # the user's param groups are as they wrote them after the run (the step ran with momentum and decay 0)
    assert [(g["momentum"], g["weight_decay"]) for g in result["param_groups"]] == [(0.9, 0.05), (0.5, 0.0)]
    ops = [op for link, op, tag, numel, dtype in result["trace"] if tag.startswith("bucket")]
    assert ops == (["all_reduce"] * 4 + ["all_gather"] * 8 if case == "dgc-warmup" else ["all_gather"] * 12)


def test_each_dgc_correction_changes_the_result(runs):
    """The reference tells each correction apart (so the equality above could not hold without it)."""
    result = runs("dgc")
    expected, _, _ = dgc_reference(result)
    assert max_abs_diff(expected, dgc_reference(result, masking=True)[0])[0] > 1e-4
    assert max_abs_diff(runs("dgc")["state"], runs("dgc-masked")["state"])[0] > 1e-4
    assert max_abs_diff(runs("dgc")["state"], runs("dgc-clipped")["state"])[0] > 1e-4
    assert max_abs_diff(runs("dgc")["state"], runs("dgc-nesterov")["state"])[0] > 1e-4


def test_a_resumed_dgc_run_equals_the_uninterrupted_one(runs):
    for rank in (0, 1):
        whole, resumed = runs("dgc", rank), runs("dgc-resumed", rank)
        assert max_abs_diff(whole["state"], resumed["state"])[0] == 0.0
        for key in ("residuals", "velocities"):
            assert set(whole[key]) == set(resumed[key]) and whole[key]
            for name in whole[key]:
                assert torch.equal(whole[key][name], resumed[key][name]), (key, name)


def test_a_dgc_resume_at_another_world_size_keeps_the_sums_of_residuals_and_velocities(runs):
    for key in ("residuals", "velocities"):
        parts = [runs("dgc-part", rank)[key] for rank in (0, 1)]
        now = [runs("dgc-resharded", rank)[key] for rank in (0, 1, 2)]
        assert set(now[0]) == set(parts[0]) and parts[0]
        for name in parts[0]:
            owed = parts[0][name] + parts[1][name]
            assert torch.allclose(now[0][name] + now[1][name] + now[2][name], owed, atol=1e-6), (key, name)
            assert torch.allclose(now[2][name], owed / 3, atol=1e-7)
    assert "error-feedback residuals and velocities of 2 processes are re-sharded over 3" in runs.said


def test_the_corrections_and_the_warm_up_are_said_once_each(runs):
    assert (
        "commsched topk: DGC's corrections under SGD: momentum correction, weight decay before "
        "accumulation; the optimizer steps with momentum and weight decay 0" in runs.said
    )
    assert "momentum correction, momentum factor masking, weight decay" in runs.said  # dgc-masked
    assert "local clipping to norm 0.05/sqrt(P) per parameter" in runs.said
    assert re.search(r"density warm-up 1 -> 0.25 -> 0.1 over the first 8 optimizer steps \(as set", runs.said)


@needs_root
def test_hierarchical_dgc_equals_the_single_process_reference(two_nodes):
    """2 nodes x 2 workers, DGC's corrections (masking included) and the density's warm-up on the two-level exchange."""
    result = two_nodes("hier-dgc")
    expected, residuals, velocities = hierarchical_dgc_reference(
        result, [1.0] * 2 + [0.25] * 2 + [0.1] * 6, masking=True
    )
    diff, key = max_abs_diff(expected, result["state"])
    assert diff <= 1e-5, f"{diff} at {key}"
    names, padded, _ = result["layout"]
    for rank in range(4):
        mine = two_nodes("hier-dgc", rank)
        assert max_abs_diff(mine["state"], result["state"])[0] == 0.0
        for key, expected_shards in (("residuals", residuals), ("velocities", velocities)):
            whole = torch.zeros(padded)
            whole[: sum(mine[key][n].numel() for n in names)] = torch.cat([mine[key][n].reshape(-1) for n in names])
            assert torch.allclose(whole.view(2, -1)[rank % 2], expected_shards[rank], atol=1e-6), (key, rank)
    across = [op for link, op, tag, *_ in result["trace"] if tag.startswith("bucket") and link == "inter"]
    assert across == ["all_reduce"] * 2 + ["all_gather"] * 8


def test_a_dense_resume_of_dgc_velocities_is_refused_not_dropped(runs):
    refused = runs("dense-from-dgc")["refused"]
    assert "['momentum']" in refused and "resuming would drop it" in refused


def test_adamw_runs_the_defaults_as_error_feedback_alone_and_lightning_clips_it(runs):
    """The corrections are SGD's: under AdamW the defaults equal error feedback alone bit for bit, gradient
    clipping included (Lightning's, once), and no velocity is kept."""
    for rank in (0, 1):
        default, plain = runs("adamw-default", rank), runs("adamw-plain", rank)
        assert max_abs_diff(default["state"], plain["state"])[0] == 0.0
        assert default["velocities"] == {}
    assert (
        "AdamW: DGC's corrections apply to torch's SGD (without dampening or maximize) only: error feedback alone"
        in runs.said
    )
