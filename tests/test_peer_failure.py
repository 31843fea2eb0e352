"""A peer that dies or hangs ends the run with an error naming the failed collective, never a silent hang."""

from __future__ import annotations

import re
import time

import pytest
import torch

from commsched import state
from conftest import ended_with_an_error, run_worker


@pytest.mark.parametrize("mode", ["peer-dies", "peer-hangs"])
def test_peer_failure_ends_run_with_error(mode, tmp_path):
    started = time.monotonic()
    proc = run_worker("run_failure.py", mode, str(tmp_path), timeout=240)  # the strategy's timeout is 15 s
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    ended_with_an_error(proc)
    said = "rank 1 (process " if mode == "peer-dies" else "a peer process probably died"
    assert "commsched.errors.PeerFailureError" in output and said in output, output[-3000:]
    assert elapsed < 180
    if mode == "peer-dies":  # the survivor ended its issuer threads (one left in the backend at exit can abort)
        assert "commsched-test: rank 0 issuer threads alive at exit: []" in output, output[-3000:]


def test_a_checkpoint_saved_after_a_peer_died_is_written_at_once_and_says_what_it_holds(tmp_path):
    """Lightning's OnExceptionCheckpoint on the survivor: no gather on the broken group (it would wait
    for the timeout and fail), the weights as they are, and one line saying what they are."""
    proc = run_worker("run_failure.py", "peer-dies-saved", str(tmp_path), timeout=240)
    output = proc.stdout + proc.stderr
    ended_with_an_error(proc)
    assert "rank 1 (process " in output and "has exited" in output
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert "commsched" not in saved and saved["state_dict"]
    assert "commsched: this checkpoint, saved after the run failed, holds this rank's weights (" in output


def _saved_after_failure(tmp_path, mode):
    proc = run_worker("run_failure.py", mode, str(tmp_path), timeout=240)
    output = proc.stdout + proc.stderr
    ended_with_an_error(proc)
    assert "rank 1 (process " in output and "has exited" in output, output[-3000:]
    # the saving neither waited on nor failed in a barrier on the broken group: the run ended with its own error
    raised = [line for line in proc.stderr.splitlines() if re.match(r"\[rank0\]: [\w.]+(Error|Exception)\b", line)]
    assert raised and raised[-1].startswith("[rank0]: commsched.errors.PeerFailureError"), output[-3000:]
    assert "commsched-test: rank 0 issuer threads alive at exit: []" in output, output[-3000:]
    return torch.load(tmp_path / "on_exception.ckpt", weights_only=True), output


@pytest.fixture(scope="module")
def chain_reference(tmp_path_factory):
    """The same model under Lightning's ddp: its weights and momentum after 3 steps (the model before the
    step the failure interrupted), its BatchNorm statistics after the 4th forward (which ran before that
    step, and which the taken-back step keeps)."""
    out = tmp_path_factory.mktemp("chain-reference")
    proc = run_worker("run_failure.py", "chain-reference", str(out), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = torch.load(out / "reference.ckpt", weights_only=True)
    buffers = {
        k: v
        for k, v in torch.load(out / "after-forward-4.ckpt", weights_only=True)["state_dict"].items()
        if ".running_" in k or k.endswith("num_batches_tracked")
    }
    reference["state_dict"].update(buffers)
    return reference


def _momenta(checkpoint):
    return [s["momentum_buffer"] for _, s in sorted(checkpoint["optimizer_states"][0]["state"].items())]


def test_a_dear_step_interrupted_part_way_is_taken_back(tmp_path, chain_reference):
    """Rank 1 dies between two of step 3's all-gathers: rank 0 has applied that step to its first
    layer, and that layer and the BatchNorm after it have run, when the failure reaches it. What
    OnExceptionCheckpoint saves is the model of 3 steps, weights, BatchNorm statistics and momentum,
    whole (against ddp's), and one line says the step was taken back."""
    saved, output = _saved_after_failure(tmp_path, "gather-dies")
    assert "the last optimizer step was taken back (1 of 3 buckets had applied it" in output, output[-3000:]
    # Lightning counted step 3 before it was taken back: the checkpoint says so, and a resume from it is warned
    assert saved["global_step"] == 4 and saved[state.AFTER_FAILURE_KEY].startswith(
        "the last optimizer step was taken back"
    )
    for key, value in chain_reference["state_dict"].items():
        assert torch.allclose(saved["state_dict"][key], value, atol=1e-6, rtol=0), key
    for ours, theirs in zip(_momenta(saved), _momenta(chain_reference), strict=True):
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)


def test_without_rollback_copies_the_mixed_model_is_said_for_what_it_is(tmp_path, chain_reference):
    saved, output = _saved_after_failure(tmp_path, "gather-dies-no-rollback")
    assert "1 of 3 buckets hold the last optimizer step's update and the others do not" in output, output[-3000:]
    first = "layers.0.weight"
    assert not torch.allclose(saved["state_dict"][first], chain_reference["state_dict"][first], atol=1e-6, rtol=0)
    assert torch.allclose(
        saved["state_dict"]["layers.5.weight"], chain_reference["state_dict"]["layers.5.weight"], atol=1e-6, rtol=0
    )


def test_a_resume_from_a_checkpoint_saved_after_a_failure_is_warned(caplog):
    held = "the last optimizer step was taken back (1 of 3 buckets had applied it ...)"
    with caplog.at_level("INFO", logger="commsched"):
        state.warn_if_saved_after_failure({"global_step": 4, state.AFTER_FAILURE_KEY: held})
        state.warn_if_saved_after_failure({"global_step": 4})  # an ordinary checkpoint: nothing said
    said = [r.getMessage() for r in caplog.records]
    assert (
        len(said) == 1 and "its step count (4) includes a step its weights do not hold" in said[0] and held in said[0]
    )
