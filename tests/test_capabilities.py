"""Root without CAP_NET_ADMIN (a default container): what cannot emulate a network says so in one
line, checked by capability, not uid. Run for real in a process whose bounding set lacks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None, reason="needs root and util-linux's setpriv to drop capabilities"
)


def without_capabilities(*argv: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SETPRIV, "--bounding-set", "-net_admin,-sys_admin", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def test_the_reason_names_the_missing_capabilities(tmp_path):
    code = "from commsched.cluster.netns import unavailable_reason; print(unavailable_reason())"
    proc = without_capabilities(sys.executable, "-c", code, cwd=tmp_path)
    assert "CAP_NET_ADMIN" in proc.stdout and "CAP_SYS_ADMIN" in proc.stdout, proc.stdout + proc.stderr
    with_them = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert with_them.stdout.strip() == "None"


def test_the_cluster_refuses_in_one_line(tmp_path):
    proc = without_capabilities(
        str(BIN / "commsched-cluster"), "--nodes", "2", "--rate", "1gbit", "--", "true", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "CAP_NET_ADMIN" in proc.stderr, proc.stderr


def test_the_demo_falls_back_to_the_unlimited_loopback_and_says_so(tmp_path):
    proc = without_capabilities(
        sys.executable, "-m", "commsched.bench.demo", "--steps", "2", "--rounds", "1", cwd=tmp_path
    )
    output = " ".join((proc.stdout + proc.stderr).split())  # the console wraps long lines
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    assert "CAP_NET_ADMIN" in output and "running on the unlimited loopback instead of 600mbit" in output, output[
        -3000:
    ]
    assert "dear trained" in output
    kept = output.split("and the profile are in ")[1].split()[0]  # the demo names only files it keeps
    assert (tmp_path / kept / "bench.csv").is_file() and (tmp_path / kept / "small_cnn" / "profile.json").is_file()
