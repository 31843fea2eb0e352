"""The kill matrix: under every schedule, a rank killed at batch start, mid-backward, mid-step or
mid-checkpoint ends the survivor's run in seconds, with an error exit (no signal, no abort), one
line naming the dead rank, no issuer thread left and no partial checkpoint; resuming from the last
checkpoint gives the model an uninterrupted run gives."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import ended_with_an_error, max_abs_diff, run_worker

SCHEDULES = ["wfbp", "dear", "deft", "topk", "streams"]
POINTS = ["batch-start", "mid-backward", "mid-step", "mid-checkpoint"]


def _kill(schedule: str, point: str, out):
    started = time.monotonic()
    proc = run_worker("run_kill.py", schedule, point, str(out), timeout=240)
    return proc, time.monotonic() - started


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_killed_rank_ends_the_run_cleanly(schedule, point, tmp_path):
    proc, elapsed = _kill(schedule, point, tmp_path)
    output = proc.stdout + proc.stderr
    ended_with_an_error(proc)  # Lightning's launcher SIGKILLs a survivor still running 5 s after a child died
    assert elapsed < 90, f"{elapsed:.0f} s"
    named = [line for line in output.splitlines() if "rank 1 (process " in line and "has exited" in line]
    assert named, output[-3000:]
    assert "training finished without the expected failure" not in output
    assert "commsched-test: rank 0 issuer threads alive at exit: []" in output, output[-3000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert saved == ["step2.ckpt"], saved  # step 4's was never begun or not written in part
    parts = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.commsched"))
    assert set(parts) <= {"step2.ckpt.commsched"}, parts  # no rank's state left beside a checkpoint not written
    assert torch.load(tmp_path / "checkpoints" / "step2.ckpt", weights_only=True)["global_step"] == 2


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Final weights of uninterrupted runs: Lightning's ddp (every exact schedule equals it) and top-k's own."""
    finals = {}
    for schedule in ("ddp", "topk"):
        out = tmp_path_factory.mktemp(f"whole-{schedule}")
        proc = run_worker("run_kill.py", schedule, "none", str(out), timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        finals[schedule] = torch.load(out / "final.pt", weights_only=True)
    return finals


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_resuming_after_a_kill_equals_the_uninterrupted_run(schedule, tmp_path, uninterrupted):
    proc, _ = _kill(schedule, "mid-backward", tmp_path)
    ended_with_an_error(proc)
    resumed = run_worker("run_kill.py", schedule, "resume", str(tmp_path), timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    diff, key = max_abs_diff(final, uninterrupted["topk" if schedule == "topk" else "ddp"])
    assert diff <= 1e-5, f"{schedule}: {key} differs by {diff:.3g}"
