"""A newcomer's second day: their own script on one and two CPU devices, at the defaults.

Every commsched strategy runs on one device as on two, ends with the weights Lightning's ddp gives,
writes its files into the logger's run folder (not the working directory) and ends with a closing
summary of what it did."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import WORKERS, max_abs_diff

STRATEGIES = ("ddp", "dear", "wfbp", "deft", "dear-planned", "dear-quiet")
QUIET = ("dear-quiet",)
"""Fit with logger=False and enable_checkpointing=False: no run folder, so nothing may be written."""
ONE_PROCESS_ONLY = ("topk",)
"""One process has nothing to exchange: top-k is off there, and the model is ddp's."""


@pytest.fixture(scope="module", params=[1, 2], ids=["1 device", "2 devices"])
def newcomer(request, tmp_path_factory):
    cwd = tmp_path_factory.mktemp(f"newcomer-{request.param}")
    strategies = (*STRATEGIES, *ONE_PROCESS_ONLY) if request.param == 1 else STRATEGIES
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "newcomer.py"), str(request.param), *strategies],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return cwd, proc.stdout + proc.stderr, strategies


@pytest.mark.parametrize("strategy", STRATEGIES[1:] + ONE_PROCESS_ONLY)
def test_every_strategy_trains_the_model_ddp_trains(newcomer, strategy):
    cwd, _, strategies = newcomer
    if strategy not in strategies:
        pytest.skip(f"{strategy} is ddp's model on one process only")
    reference = torch.load(cwd / "final-ddp.pt")
    diff, key = max_abs_diff(torch.load(cwd / f"final-{strategy}.pt"), reference)
    assert diff <= 1e-5, f"{strategy}: {key} differs from ddp by {diff:.3g}"


def test_nothing_lands_in_the_working_directory(newcomer):
    cwd, _, strategies = newcomer
    assert sorted(p.name for p in cwd.iterdir()) == sorted(["lightning_logs", *(f"final-{s}.pt" for s in strategies)])
    versions = sorted((cwd / "lightning_logs").iterdir(), key=lambda p: int(p.name.split("_")[1]))
    assert len(versions) == len(strategies) - len(
        QUIET
    )  # one run folder per fit with a logger; the commsched files are inside
    planned = versions[strategies.index("dear-planned")]
    assert (planned / "commsched_plan.json").is_file() and (planned / "commsched_profile" / "profile.json").is_file()
    assert not any(p.name.startswith(".partial") for p in planned.rglob("*"))


def test_each_fit_ends_with_a_summary_of_what_commsched_did(newcomer):
    _, output, _ = newcomer
    for strategy in ("dear", "wfbp", "deft"):
        lines = [line for line in output.splitlines() if line.startswith(f"commsched {strategy}: ")]
        assert any("bucket(s) for" in line for line in lines), output[-4000:]
        assert any("a median step of" in line and "the training loop waited" in line for line in lines), output[-4000:]
        assert any("continue with: trainer.fit(model, ckpt_path=" in line for line in lines), output[-4000:]
    assert "commsched dear: files in " in output and "commsched_plan.json, commsched_profile/profile.json" in output
    assert (
        "not saved: the run has no folder (no logger, no checkpoints)" in output
    )  # the quiet fit still says what it decided
