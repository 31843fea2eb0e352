"""`pip install commsched` without the lab: the strategies train and the command line answers; the
lab's tools say which extra brings what they need. An install without matplotlib is made by hiding
it from every process of the run (a `sitecustomize` that refuses the import), the same as a fresh
environment where it was never installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import WORKERS

HIDE_LAB = """
import importlib.abc, importlib.metadata, sys

HIDDEN = "matplotlib"

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == HIDDEN or name.startswith(HIDDEN + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

def _no_metadata(real):
    def lookup(name, *args, **kwargs):
        if name == HIDDEN:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name, *args, **kwargs)
    return lookup

sys.meta_path.insert(0, _NotInstalled())
importlib.metadata.version = _no_metadata(importlib.metadata.version)  # what "is it installed?" checks read
importlib.metadata.distribution = _no_metadata(importlib.metadata.distribution)
"""


@pytest.fixture
def without_lab(tmp_path) -> dict[str, str]:
    """The environment of a process (and of the workers it starts) in which matplotlib is not installed."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_LAB)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_the_environment_hides_the_lab(without_lab):
    """The hiding itself works in a child process, for an import and for a look at what is installed
    (Lightning and torchmetrics ask the package metadata), or the tests below test nothing."""
    proc = subprocess.run([sys.executable, "-c", "import matplotlib"], env=without_lab, capture_output=True, text=True)
    assert proc.returncode != 0 and "No module named 'matplotlib'" in proc.stderr
    asked = "import importlib.metadata as m; m.version('matplotlib')"
    proc = subprocess.run([sys.executable, "-c", asked], env=without_lab, capture_output=True, text=True)
    assert proc.returncode != 0 and "PackageNotFoundError" in proc.stderr


def test_dear_trains_across_two_processes_without_the_lab(without_lab, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "newcomer.py"), "2", "dear"],
        cwd=tmp_path,
        env=without_lab,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = torch.load(tmp_path / "final-dear.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.quick
@pytest.mark.parametrize("command", ["commsched-bench", "commsched-simulate"])
def test_the_labs_commands_name_the_extra_they_need(without_lab, command):
    binary = Path(sys.executable).with_name(command)
    proc = subprocess.run([str(binary)], env=without_lab, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs matplotlib" in proc.stderr and "pip install 'commsched[lab]'" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.quick
def test_train_answers_help_without_the_lab(without_lab):
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("commsched-train")), "--help"],
        env=without_lab,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
