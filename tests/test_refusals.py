"""Bad input gets a clear error naming the field and what is allowed; before spawning where possible."""

from __future__ import annotations

import math
from datetime import timedelta

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import commsched
from commsched import CommSchedConfigError, DeFTOptions, FusionOptions, LinkOptions, ProfileOptions, TuningOptions
from conftest import ended_with_an_error, run_worker


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
    "kwargs, spelled, value, allowed",
    [
        ({"bucket_cap_mb": -1}, "{cls}(bucket_cap_mb={v})", -1, "> 0"),
        ({"bucket_cap_mb": 0}, "{cls}(bucket_cap_mb={v})", 0, "> 0"),
        ({"bucket_cap_mb": math.nan}, "{cls}(bucket_cap_mb={v})", math.nan, "a number > 0"),
        ({"bucket_cap_mb": "25"}, "{cls}(bucket_cap_mb={v})", "25", "number"),
        ({"bucket_cap_mb": True}, "{cls}(bucket_cap_mb={v})", True, "number"),
        (
            {"fusion": "mgwfbp2"},
            "{cls}(fusion={v})",
            "mgwfbp2",
            "'fixed', 'layers', 'mgwfbp', 'mgwfbp-greedy', 'dear-model', 'bayes'",
        ),
        ({"fusion": 3}, "{cls}(fusion={v})", 3, "FusionOptions"),
        ({"fusion": FusionOptions(profile_steps=0)}, "FusionOptions(profile_steps={v})", 0, ">= 1"),
        ({"fusion": FusionOptions(profile_warmup_steps=-1)}, "FusionOptions(profile_warmup_steps={v})", -1, ">= 0"),
        ({"fusion": FusionOptions(bucket_layers=1.5)}, "FusionOptions(bucket_layers={v})", 1.5, "integer"),
        (
            {"fusion": FusionOptions(plan_file="/nonexistent/plan.json")},
            "FusionOptions(plan_file={v})",
            "/nonexistent/plan.json",
            "a plan JSON",
        ),
        ({"tuning": TuningOptions(trials=0)}, "TuningOptions(trials={v})", 0, ">= 1"),
        ({"tuning": TuningOptions(trial_steps=2.5)}, "TuningOptions(trial_steps={v})", 2.5, "integer"),
        ({"tuning": TuningOptions(warmup_steps=-1)}, "TuningOptions(warmup_steps={v})", -1, ">= 0"),
        ({"tuning": TuningOptions(min_mb=0)}, "TuningOptions(min_mb={v})", 0, "> 0"),
        (
            {"tuning": TuningOptions(first_mb=500)},
            "TuningOptions(first_mb={v})",
            500,
            "within tuning.min_mb..tuning.max_mb",
        ),
        ({"profile": ProfileOptions(steps=-2)}, "ProfileOptions(steps={v})", -2, ">= 0"),
        ({"profile": ProfileOptions(probe="yes")}, "ProfileOptions(probe={v})", "yes", "True or False"),
        ({"links": LinkOptions(primary_backend="mpi")}, "LinkOptions(primary_backend={v})", "mpi", "'gloo', 'nccl'"),
        ({"schedule": "fancy"}, "{cls}(schedule={v})", "fancy", "'wfbp', 'dear'"),
        ({"broadcast_buffers": "yes"}, "{cls}(broadcast_buffers={v})", "yes", "True or False"),
        ({"trace_collectives": 1}, "{cls}(trace_collectives={v})", 1, "True or False"),
        ({"timeout": 30}, "{cls}(timeout={v})", 30, "timedelta"),
        ({"timeout": timedelta(seconds=0)}, "{cls}(timeout={v})", timedelta(seconds=0), "timedelta"),
        ({"start_method": "thread"}, "{cls}(start_method={v})", "thread", "'popen', 'spawn'"),
        ({"deft": DeFTOptions(capacity=0)}, "DeFTOptions(capacity={v})", 0, "a number > 0"),
        ({"deft": DeFTOptions(warmup_steps=-1)}, "DeFTOptions(warmup_steps={v})", -1, ">= 0"),
        ({"deft": DeFTOptions(cost_repeats=0)}, "DeFTOptions(cost_repeats={v})", 0, ">= 1"),
        (
            {"deft": DeFTOptions(fallback="sometimes")},
            "DeFTOptions(fallback={v})",
            "sometimes",
            "'when_faster', 'when_undelayed', 'never'",
        ),
        ({"deft": "fast"}, "{cls}(deft={v})", "fast", "DeFTOptions"),
        ({"comm_dtype": "fp8"}, "{cls}(comm_dtype={v})", "fp8", "'fp32', 'bf16', 'fp16'"),
        ({"comm_dtype": "float16"}, "{cls}(comm_dtype={v})", "float16", "'fp32', 'bf16', 'fp16'"),
        (
            {"ddp_comm_hook": "powerSGD"},
            "{cls}(ddp_comm_hook={v})",
            "powerSGD",
            "a callable hook(state, bucket) -> torch.futures.Future",
        ),
        (
            {"comm_dtype": "fp16", "ddp_comm_hook": default_hooks.bf16_compress_hook},
            "{cls}(comm_dtype={v})",
            "fp16",
            "'bf16', the dtype ddp_comm_hook=bf16_compress_hook sends",
        ),
    ],
)
@pytest.mark.parametrize("cls", [commsched.DeARStrategy, commsched.WFBPStrategy, commsched.DeFTStrategy])
def test_bad_argument_names_field_and_allowed_values(cls, kwargs, spelled, value, allowed):
    """Named as the Python user wrote it: the strategy's own argument, or the options class's field."""
    with pytest.raises(CommSchedConfigError) as error:
        cls(**kwargs)
    message = str(error.value)
    assert message.startswith(f"commsched: invalid {spelled.format(cls=cls.__name__, v=repr(value))}; allowed: "), (
        message
    )
    assert allowed in message


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (
            {"compression": commsched.CompressionOptions(density=0)},
            "Fix: e.g. CompressionOptions(density=0.01) (the default).",
        ),
        ({"fusion": "greedy"}, "Fix: did you mean {cls}(fusion='mgwfbp-greedy')?"),
        ({"fusion": FusionOptions(profile_steps=0)}, "Fix: e.g. FusionOptions(profile_steps=5) (the default)."),
    ],
)
def test_a_refusal_says_how_to_fix_it(kwargs, fix):
    with pytest.raises(CommSchedConfigError) as error:
        commsched.WFBPStrategy(**kwargs)
    assert str(error.value).endswith(fix.format(cls="WFBPStrategy")), str(error.value)


def test_density_is_refused_in_the_same_words_whatever_is_wrong():
    for density in (0, 2, -1, math.nan, "abc"):
        with pytest.raises(CommSchedConfigError, match=r"allowed: a number in \(0, 1\]\."):
            commsched.WFBPStrategy(compression=commsched.CompressionOptions(density=density))


def test_a_network_interface_this_machine_lacks_is_refused_before_any_worker():
    with pytest.raises(
        CommSchedConfigError,
        match=r"invalid LinkOptions\(secondary_ifname='eth9'\); allowed: a network "
        r"interface of this machine: lo",
    ):
        commsched.DeFTStrategy(links=LinkOptions(secondary_ifname="eth9"))
    commsched.DeFTStrategy(links=LinkOptions(secondary_ifname="lo"))


def test_an_unknown_argument_is_refused_with_the_closest_known_one():
    with pytest.raises(
        CommSchedConfigError,
        match=r"DeARStrategy\(\) has no argument 'bucket_cap'; allowed: schedule, fusion, "
        r"bucket_cap_mb, .* Fix: did you mean DeARStrategy\(bucket_cap_mb=...\)\?",
    ):
        commsched.DeARStrategy(bucket_cap=2)
    with pytest.raises(CommSchedConfigError, match="has no argument 'find_unused_parameters'"):
        commsched.DeARStrategy(find_unused_parameters=True)


@pytest.mark.parametrize("name", ["dear", "wfbp"])
def test_sync_batchnorm_on_cpu_refused_before_spawning(name):
    with pytest.raises(CommSchedConfigError, match="sync_batchnorm=True"):
        pl.Trainer(strategy=name, accelerator="cpu", devices=2, sync_batchnorm=True, logger=False)


@pytest.mark.parametrize(
    "mode, message",
    [
        ("lbfgs", "optimizer LBFGS re-evaluates the closure"),
        ("plan-mismatch", "differs between ranks"),
        ("fused-fp16", "Adam unscales inside its own step (fused=True)"),
        ("lazy", "parameter 'lazy.weight' is not made yet (a lazy module"),
    ],
)
def test_refused_in_workers_with_clear_error(mode, message, tmp_path):
    proc = run_worker("run_failure.py", mode, str(tmp_path), timeout=300)
    output = proc.stdout + proc.stderr
    ended_with_an_error(proc)
    assert "training finished" not in output
    assert message in output


@pytest.mark.parametrize(
    "kwargs, allowed",
    [
        ({"eps": 0}, "(0, 1)"),
        ({"eps": 1.5}, "(0, 1)"),
        ({"max_tries": 0}, ">= 1"),
        ({"growth": 1.0}, "> 1"),
        ({"batch_size": 0}, ">= 1"),
        ({"max_staleness": -1}, ">= 0"),
    ],
)
def test_preserver_refuses_bad_settings(kwargs, allowed):
    with pytest.raises(CommSchedConfigError) as error:
        commsched.Preserver(**kwargs)
    ((name, value),) = kwargs.items()
    assert f"invalid Preserver({name}={value!r})" in str(error.value) and allowed in str(error.value)
