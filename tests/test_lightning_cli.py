"""LightningCLI scripts (jsonargparse) choose commsched's strategies as they choose Lightning's: by name on the
command line, or by class path with `init_args` (nested options objects included) in a YAML config, and a
bad value is refused with commsched's message naming the field (workers/run_lightning_cli.py, 2 processes)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import max_abs_diff, run_worker

pytest.importorskip("jsonargparse")

COMMON = [
    "fit",
    "--trainer.accelerator=cpu",
    "--trainer.devices=2",
    "--trainer.max_steps=12",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
]
CONFIG = """
trainer:
  strategy:
    class_path: commsched.WFBPStrategy
    init_args:
      bucket_cap_mb: 0.0005
      streams:
        count: 2
      comm_dtype: fp32
"""


def _fit(tmp_path, name: str, *args: str):
    out = tmp_path / name
    proc = run_worker("run_lightning_cli.py", *COMMON, *args, env={"COMMSCHED_CLI_OUT": str(out)})
    return proc, out.with_suffix(".pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    proc, weights = _fit(tmp_path_factory.mktemp("cli"), "ddp", "--trainer.strategy=ddp")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(weights)


def test_a_strategy_named_on_the_command_line_trains_what_ddp_trains(tmp_path, reference):
    proc, weights = _fit(tmp_path, "dear", "--trainer.strategy=dear")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "STRATEGY DeARStrategy" in proc.stdout
    diff, where = max_abs_diff(torch.load(weights), reference)
    assert diff <= 1e-5, f"{diff:.2e} from ddp at {where}"


def test_a_class_path_with_nested_options_in_a_config_trains_what_ddp_trains(tmp_path, reference):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    proc, weights = _fit(tmp_path, "wfbp", f"--config={config}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "STRATEGY WFBPStrategy" in proc.stdout and "2 streams" in proc.stdout + proc.stderr
    diff, where = max_abs_diff(torch.load(weights), reference)
    assert diff <= 1e-5, f"{diff:.2e} from ddp at {where}"


def test_a_bad_value_is_refused_with_commsched_message(tmp_path):
    proc, weights = _fit(
        tmp_path, "bad", "--trainer.strategy=commsched.DeARStrategy", "--trainer.strategy.comm_dtype=fp8"
    )
    assert proc.returncode != 0 and not os.path.exists(weights)
    assert "invalid DeARStrategy(comm_dtype='fp8'); allowed: one of 'fp32', 'bf16', 'fp16'" in proc.stderr, proc.stderr[
        -3000:
    ]
