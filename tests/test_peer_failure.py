"""A peer that dies or hangs ends the run with an error naming the failed collective, never a silent hang."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import run_worker


@pytest.mark.parametrize("mode", ["peer-dies", "peer-hangs"])
def test_peer_failure_ends_run_with_error(mode, tmp_path):
    started = time.monotonic()
    proc = run_worker("run_failure.py", mode, str(tmp_path), timeout=240)  # the strategy's timeout is 15 s
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "PeerFailureError" in output and "A peer process probably died" in output
    assert elapsed < 180
    if mode == "peer-dies":  # the survivor ended its issuer threads (one left in the backend at exit can abort)
        assert "commsched-test: rank 0 issuer threads alive at exit: []" in output, output[-3000:]


def test_a_checkpoint_saved_after_a_peer_died_is_written_at_once_and_says_what_it_holds(tmp_path):
    """Lightning's OnExceptionCheckpoint on the survivor: no gather on the broken group (it would wait
    for the timeout and fail), the weights as they are, and one line saying what they are."""
    proc = run_worker("run_failure.py", "peer-dies-saved", str(tmp_path), timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "A peer process probably died" in output
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert "commsched" not in saved and saved["state_dict"]
    assert "commsched: this checkpoint, saved after the run failed, holds this rank's weights as they are" in output
