"""torchmetrics, as users log it from a LightningModule, under every schedule at its defaults: the
weights, what a metric synced on every step returned at each step (an all-gather on the default group
in the middle of a step whose exchanges are in flight on the schedule's links), and the Trainer's final
metrics (epoch-synced accuracy, a synced validation loss) all equal ddp's."""

from __future__ import annotations

import pytest
import torch

from conftest import max_abs_diff, run_worker

SCHEDULES = ["wfbp", "dear", "deft"]
STEPS = 30  # 3 epochs of 160 samples, 8 a batch on each of 2 ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchmetrics")
    proc = run_worker("run_torchmetrics.py", str(out), "ddp", *SCHEDULES, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"torchmetrics runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return lambda schedule, rank: torch.load(out / f"{schedule}.rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_metrics_synced_every_step_and_every_epoch_read_what_they_read_under_ddp(runs, schedule):
    for rank in (0, 1):
        got, expected = runs(schedule, rank), runs("ddp", rank)
        assert got["steps"] == expected["steps"] == STEPS
        diff, key = max_abs_diff(got["state"], expected["state"])
        assert diff <= 1e-5, f"rank {rank}: {key} differs from ddp by {diff:.3g}"
        assert len(got["mean_seen"]) == len(expected["mean_seen"]) == STEPS
        seen = max(abs(a - b) for a, b in zip(got["mean_seen"], expected["mean_seen"]))
        assert seen <= 1e-6, f"rank {rank}: the step-synced metric differs from ddp's by {seen:.3g}"
        assert got["metrics"].keys() == expected["metrics"].keys() >= {"accuracy_epoch", "val_loss", "mean_loss"}
        for name, value in expected["metrics"].items():
            assert got["metrics"][name] == pytest.approx(value, abs=1e-6), name
