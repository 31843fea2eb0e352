"""Bad input gets a clear error naming the field and what is allowed; before spawning where possible."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

import commsched
import lightning.pytorch as pl
from commsched import CommSchedConfigError
from lightning.pytorch.strategies import StrategyRegistry

from conftest import run_worker


def test_import_registers_strategies_with_descriptions():
    for name, cls in (("dear", commsched.DeARStrategy), ("wfbp", commsched.WFBPStrategy)):
        assert StrategyRegistry[name]["strategy"] is cls
        assert "commsched" in StrategyRegistry[name]["description"]
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert type(trainer.strategy) is cls


def test_every_argument_has_a_default():
    for cls in (commsched.DeARStrategy, commsched.WFBPStrategy):
        cls()


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        ({"bucket_cap_mb": -1}, "bucket_cap_mb", "> 0"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb", "> 0"),
        ({"bucket_cap_mb": math.nan}, "bucket_cap_mb", "finite"),
        ({"bucket_cap_mb": "25"}, "bucket_cap_mb", "number"),
        ({"bucket_cap_mb": True}, "bucket_cap_mb", "number"),
        ({"fusion": "mgwfbp2"}, "fusion", "'fixed', 'layers', 'mgwfbp', 'mgwfbp-greedy', 'dear-model', 'bayes'"),
        ({"plan_profile_steps": 0}, "plan_profile_steps", ">= 1"),
        ({"plan_warmup_steps": -1}, "plan_warmup_steps", ">= 0"),
        ({"bayes_trials": 0}, "bayes_trials", ">= 1"),
        ({"bayes_trial_steps": 2.5}, "bayes_trial_steps", "integer"),
        ({"bayes_warmup_steps": -1}, "bayes_warmup_steps", ">= 0"),
        ({"bayes_min_mb": 0}, "bayes_min_mb", "> 0"),
        ({"bayes_first_mb": 500}, "bayes_first_mb", "within bayes_min_mb..bayes_max_mb"),
        ({"plan_file": "/nonexistent/plan.json"}, "plan_file", "a plan JSON"),
        ({"profile_steps": -2}, "profile_steps", ">= 0"),
        ({"bucket_layers": 0}, "bucket_layers", ">= 1"),
        ({"bucket_layers": 1.5}, "bucket_layers", "integer"),
        ({"broadcast_buffers": "yes"}, "broadcast_buffers", "True or False"),
        ({"trace_collectives": 1}, "trace_collectives", "True or False"),
        ({"timeout": 30}, "timeout", "timedelta"),
        ({"timeout": timedelta(seconds=0)}, "timeout", "timedelta"),
        ({"start_method": "thread"}, "start_method", "'popen', 'spawn'"),
    ],
)
@pytest.mark.parametrize("cls", [commsched.DeARStrategy, commsched.WFBPStrategy])
def test_bad_argument_names_field_and_allowed_values(cls, kwargs, field, allowed):
    with pytest.raises(CommSchedConfigError) as error:
        cls(**kwargs)
    message = str(error.value)
    assert field in message and allowed in message and repr(kwargs[field]) in message


def test_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="find_unused"):
        commsched.DeARStrategy(find_unused_parameters=True)


@pytest.mark.parametrize("name", ["dear", "wfbp"])
def test_sync_batchnorm_on_cpu_refused_before_spawning(name):
    with pytest.raises(CommSchedConfigError, match="sync_batchnorm=True"):
        pl.Trainer(strategy=name, accelerator="cpu", devices=2, sync_batchnorm=True, logger=False)


@pytest.mark.parametrize(
    "mode, message",
    [
        ("manual", "supports automatic optimization only"),
        ("lbfgs", "optimizer LBFGS re-evaluates the closure"),
        ("plan-mismatch", "differs between ranks"),
    ],
)
def test_refused_in_workers_with_clear_error(mode, message):
    proc = run_worker("run_failure.py", mode, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "training finished" not in output
    assert message in output
