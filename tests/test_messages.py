"""DeFT as a user calls it from the Python API: guarded by default, saying once (rank 0, default
logging level, also when the user configured logging at INFO) what ran and why, and warning when a
delayed plan runs unguarded because the user turned the guard off."""

from __future__ import annotations

import dataclasses
import json

import pytest
from omegaconf import OmegaConf

import commsched
from conftest import run_worker
from test_cli import composed


def deft_run(tmp_path, logging_setup: str, guard: str) -> tuple[dict, str]:
    proc = run_worker("run_deft_messages.py", logging_setup, str(tmp_path), guard)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("logging_setup", ["plain", "info"])
def test_deft_says_once_what_ran_and_why(tmp_path, logging_setup):
    _, said = deft_run(tmp_path, logging_setup, "default")
    decisions = [line for line in said.splitlines() if "commsched deft:" in line and "run by" in line]
    assert len(decisions) == 1, said[-3000:]
    assert "mu = c_secondary/c_primary" in decisions[0]
    assert "deft.fallback=never" not in decisions[0]


def test_the_python_default_is_guarded_and_off_means_unguarded_with_a_warning(tmp_path):
    guarded, said = deft_run(tmp_path / "guarded", "plain", "default")
    assert guarded["preserver"], "DeFTStrategy() ran without the Preserver"
    assert guarded["preserver"][-1]["accepted"] and guarded["staleness"] == 0
    assert "without the Preserver" not in said
    unguarded, said = deft_run(tmp_path / "unguarded", "plain", "off")
    assert not unguarded["preserver"] and (max(unguarded["k"]) > 1 or unguarded["staleness"] > 0)
    assert said.count("UserWarning: commsched deft: running a delayed plan without the Preserver") == 1, said[-3000:]


def test_python_and_hydra_defaults_are_the_same():
    cfg = composed("schedule=deft")
    options = commsched.DeFTStrategy().options
    assert dataclasses.asdict(options.preserver) == OmegaConf.to_container(cfg.preserver)
    assert dataclasses.asdict(options.deft) == OmegaConf.to_container(cfg.deft)
    assert options.preserver.enabled


def test_compression_defaults_are_the_same_from_python_and_hydra():
    """`compression=auto` in Hydra, `compression="auto"` in Python and `strategy="topk"` build the same
    options; `mstopk` names the paper's selection alike in both."""
    from lightning.pytorch.strategies import StrategyRegistry

    cfg = composed("schedule=wfbp", "compression=auto")
    from_python = commsched.WFBPStrategy(compression="auto").options.compression
    registered = StrategyRegistry.get("topk").options.compression
    assert dataclasses.asdict(from_python) == OmegaConf.to_container(cfg.compression) == dataclasses.asdict(registered)
    assert (from_python.method, from_python.density, from_python.error_feedback) == ("auto", 0.01, True)
    paper = commsched.WFBPStrategy(compression="mstopk").options.compression
    assert dataclasses.asdict(paper) == OmegaConf.to_container(
        composed("schedule=wfbp", "compression=mstopk").compression
    )
    assert OmegaConf.to_container(composed("schedule=wfbp").compression)["method"] == "none"


def test_stream_defaults_are_the_same_from_python_and_hydra():
    """`streams.count=auto` in Hydra and `streams="auto"` in Python search with the same options; both default
    to one stream."""
    cfg = composed("schedule=dear", "streams.count=auto")
    from_python = commsched.DeARStrategy(streams="auto").options
    assert from_python.streams.count == cfg.streams.count == "auto"
    assert dataclasses.asdict(from_python.streams) == OmegaConf.to_container(cfg.streams)
    assert commsched.WFBPStrategy().options.streams.count == composed("schedule=wfbp").streams.count == 1
