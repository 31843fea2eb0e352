"""Optimizers from the packages users bring, against Lightning's ddp with the same optimizer (2 processes,
an MLP with BatchNorm, 10 steps, a validation every 5): Prodigy and D-Adaptation sum over every
parameter of a group inside `step()`, schedule-free keeps group-level counters and swaps weights in
`train()`/`eval()`, Lion is element-wise. And torch's global step pre-hooks that read a weight: two and
three of them, each seeing the weights ddp shows it."""

from __future__ import annotations

import pytest
import torch

from conftest import max_abs_diff, run_worker

SCHEDULES = ["wfbp", "dear", "deft", "streams", "topk"]
OPTIMIZERS = ["prodigy", "dadapt", "schedulefree", "lion", "hooks2", "hooks3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("user_optimizers")
    cases = [f"{s}-{o}" for o in OPTIMIZERS for s in ["ddp", *SCHEDULES]]
    proc = run_worker("run_user_optimizers.py", str(out), *cases)
    if proc.returncode != 0:
        pytest.fail(f"runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    load = lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.output = proc.stdout + proc.stderr
    return load


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trains_the_model_ddp_trains(runs, schedule, optimizer):
    reference = runs(f"ddp-{optimizer}")
    for rank in (0, 1):
        got = runs(f"{schedule}-{optimizer}", rank)
        diff, where = max_abs_diff(got["state"], reference["state"])
        assert diff <= 1e-5, f"{schedule} with {optimizer}, rank {rank}: {diff:.2e} from ddp at {where}"
        assert got["reads"] == pytest.approx(reference["reads"], abs=1e-5), (
            "a global hook read other weights than under ddp"
        )


def test_the_reference_moves(runs):
    """The optimizers train (a test that compares models that never moved could not fail)."""
    for optimizer in OPTIMIZERS:
        state = runs(f"ddp-{optimizer}")["state"]
        assert state["net.0.weight"].abs().sum() > 0
    assert len(runs("ddp-hooks3")["reads"]) == 3 * 10


def test_the_summary_says_how_dear_stepped_each_optimizer(runs):
    assert "the optimizer (Prodigy) steps whole once every all-gather of the step has landed" in runs.output
    assert "the optimizer (SGDScheduleFree) steps whole" in runs.output
    assert "the optimizer (Lion) steps bucket by bucket as the all-gathers land" in runs.output
