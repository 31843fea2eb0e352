"""0.2.0's module paths still import after the move into folders by role: the same module object,
with a DeprecationWarning naming the new path; `python -m` on an old path runs the new module."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import commsched
from commsched.moved import MOVED


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_is_the_moved_module_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert not hasattr(commsched, old.split(".")[-1]) or getattr(commsched, old.split(".")[-1]) is module


def test_old_from_imports_give_the_same_classes():
    for old in ("commsched.strategy", "commsched.links"):
        sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning):
        from commsched.strategy import CommSchedStrategy
        from commsched.links import Link
    from commsched.comm.links import Link as MovedLink
    from commsched.runtime.strategy import CommSchedStrategy as MovedStrategy

    assert CommSchedStrategy is MovedStrategy and Link is MovedLink


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("commsched.no_such_module")


def test_python_dash_m_on_an_old_path_runs_the_new_module():
    done = subprocess.run([sys.executable, "-m", "commsched.train", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "commsched-train trains a model" in done.stdout
