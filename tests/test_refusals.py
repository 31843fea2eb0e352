"""Bad input gets a clear error naming the field and what is allowed; before spawning where possible."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

import commsched
import lightning.pytorch as pl
from commsched import CommSchedConfigError, DeFTOptions, FusionOptions, LinkOptions, ProfileOptions, TuningOptions
from lightning.pytorch.strategies import StrategyRegistry

from conftest import run_worker


def test_import_registers_strategies_with_descriptions():
    for name, cls in (("dear", commsched.DeARStrategy), ("wfbp", commsched.WFBPStrategy)):
        assert StrategyRegistry[name]["strategy"] is cls
        assert "commsched" in StrategyRegistry[name]["description"]
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert type(trainer.strategy) is cls


def test_every_argument_has_a_default():
    for cls in (commsched.DeARStrategy, commsched.WFBPStrategy, commsched.DeFTStrategy):
        cls()


@pytest.mark.parametrize(
    "kwargs, field, value, allowed",
    [
        ({"bucket_cap_mb": -1}, "fusion.bucket_cap_mb", -1, "> 0"),
        ({"bucket_cap_mb": 0}, "fusion.bucket_cap_mb", 0, "> 0"),
        ({"bucket_cap_mb": math.nan}, "fusion.bucket_cap_mb", math.nan, "finite"),
        ({"bucket_cap_mb": "25"}, "fusion.bucket_cap_mb", "25", "number"),
        ({"bucket_cap_mb": True}, "fusion.bucket_cap_mb", True, "number"),
        ({"fusion": "mgwfbp2"}, "fusion.policy", "mgwfbp2", "'fixed', 'layers', 'mgwfbp', 'mgwfbp-greedy', 'dear-model', 'bayes'"),
        ({"fusion": 3}, "fusion", 3, "FusionOptions"),
        ({"fusion": FusionOptions(profile_steps=0)}, "fusion.profile_steps", 0, ">= 1"),
        ({"fusion": FusionOptions(profile_warmup_steps=-1)}, "fusion.profile_warmup_steps", -1, ">= 0"),
        ({"fusion": FusionOptions(bucket_layers=1.5)}, "fusion.bucket_layers", 1.5, "integer"),
        ({"fusion": FusionOptions(plan_file="/nonexistent/plan.json")}, "fusion.plan_file", "/nonexistent/plan.json", "a plan JSON"),
        ({"tuning": TuningOptions(trials=0)}, "tuning.trials", 0, ">= 1"),
        ({"tuning": TuningOptions(trial_steps=2.5)}, "tuning.trial_steps", 2.5, "integer"),
        ({"tuning": TuningOptions(warmup_steps=-1)}, "tuning.warmup_steps", -1, ">= 0"),
        ({"tuning": TuningOptions(min_mb=0)}, "tuning.min_mb", 0, "> 0"),
        ({"tuning": TuningOptions(first_mb=500)}, "tuning.first_mb", 500, "within tuning.min_mb..tuning.max_mb"),
        ({"profile": -2}, "profile.steps", -2, ">= 0"),
        ({"profile": ProfileOptions(probe="yes")}, "profile.probe", "yes", "True or False"),
        ({"links": LinkOptions(primary_backend="mpi")}, "links.primary_backend", "mpi", "'gloo', 'nccl'"),
        ({"schedule": "fancy"}, "schedule", "fancy", "'wfbp', 'dear'"),
        ({"broadcast_buffers": "yes"}, "broadcast_buffers", "yes", "True or False"),
        ({"trace_collectives": 1}, "trace_collectives", 1, "True or False"),
        ({"timeout": 30}, "timeout", 30, "timedelta"),
        ({"timeout": timedelta(seconds=0)}, "timeout", timedelta(seconds=0), "timedelta"),
        ({"start_method": "thread"}, "start_method", "thread", "'popen', 'spawn'"),
        ({"deft": DeFTOptions(capacity=0)}, "deft.capacity", 0, "a number > 0"),
        ({"deft": DeFTOptions(warmup_steps=-1)}, "deft.warmup_steps", -1, ">= 0"),
        ({"deft": DeFTOptions(cost_repeats=0)}, "deft.cost_repeats", 0, ">= 1"),
        ({"deft": DeFTOptions(fallback="sometimes")}, "deft.fallback", "sometimes", "'when_faster', 'when_undelayed', 'never'"),
        ({"deft": "fast"}, "deft", "fast", "DeFTOptions"),
    ],
)
@pytest.mark.parametrize("cls", [commsched.DeARStrategy, commsched.WFBPStrategy, commsched.DeFTStrategy])
def test_bad_argument_names_field_and_allowed_values(cls, kwargs, field, value, allowed):
    with pytest.raises(CommSchedConfigError) as error:
        cls(**kwargs)
    message = str(error.value)
    assert f"{field}={value!r}" in message and allowed in message


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


@pytest.mark.parametrize("kwargs, field, value, allowed", [
    ({"eps": 0}, "Preserver.eps", 0, "> 0"),
    ({"eps": 1.5}, "Preserver.eps", 1.5, "(0, 1)"),
    ({"max_tries": 0}, "Preserver.max_tries", 0, ">= 1"),
    ({"growth": 1.0}, "Preserver.growth", 1.0, "> 1"),
    ({"batch_size": 0}, "Preserver.batch_size", 0, ">= 1"),
    ({"max_staleness": -1}, "Preserver.max_staleness", -1, ">= 0"),
])
def test_preserver_refuses_bad_settings(kwargs, field, value, allowed):
    with pytest.raises(CommSchedConfigError) as error:
        commsched.Preserver(**kwargs)
    assert f"{field}={value!r}" in str(error.value) and allowed in str(error.value)
