"""A peer that dies or hangs ends the run with an error naming the failed collective, never a silent hang."""

from __future__ import annotations

import time

import pytest

from conftest import run_worker


@pytest.mark.parametrize("mode", ["peer-dies", "peer-hangs"])
def test_peer_failure_ends_run_with_error(mode):
    started = time.monotonic()
    proc = run_worker("run_failure.py", mode, timeout=240)  # the strategy's timeout is 15 s
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "PeerFailureError" in output and "A peer process probably died" in output
    assert elapsed < 180
