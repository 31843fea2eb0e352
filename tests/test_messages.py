"""What commsched says while training from the Python API: DeFT's decision once, from rank 0, at
the default logging level, and still once when the user configured logging at INFO."""

from __future__ import annotations

import pytest

from conftest import run_worker


@pytest.mark.parametrize("logging_setup", ["plain", "info"])
def test_deft_says_once_what_ran_and_why(tmp_path, logging_setup):
    proc = run_worker("run_deft_messages.py", logging_setup, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    decisions = [line for line in proc.stderr.splitlines() if "commsched deft:" in line and "run by" in line]
    assert len(decisions) == 1, proc.stderr[-3000:]
    said = decisions[0]
    assert "mu = c_secondary/c_primary" in said
    assert "deft.fallback=when_faster" in said or "run by WFBP" in said, said
    assert "deft.fallback=never" not in said
