"""commsched-train: recipes compose, bad choices fail before any worker with the valid choices,
every model family trains for real on 2 processes, sweeps are collected, digits converge."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from commsched import CommSchedConfigError
from commsched.cli.config import register_configs, train_config, validate
from conftest import ended_with_an_error

RECIPES = sorted(p.stem for p in (Path(__file__).parents[1] / "src/commsched/conf/recipe").glob("*.yaml"))
QUIET = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]


def composed(*overrides: str):
    register_configs()
    with initialize_config_module("commsched.conf", version_base=None):
        return compose("train", overrides=list(overrides))


def train(tmp_path: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    flags = [o for o in overrides if o.startswith("-")]  # Hydra's flags (e.g. -m) go before overrides
    overrides = tuple(o for o in overrides if not o.startswith("-"))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "commsched.cli.train",
            *flags,
            f"hydra.run.dir={tmp_path}/run",
            f"hydra.sweep.dir={tmp_path}/sweep",
            *QUIET,
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


def summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def test_there_are_recipes_for_every_model_family():
    assert {"resnet", "vgg", "gpt2", "digits"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    cfg = composed(f"+recipe={recipe}")
    validate(train_config(cfg))
    assert OmegaConf.to_container(cfg, resolve=True)


MODELS = sorted(p.stem for p in (Path(__file__).parents[1] / "src/commsched/conf/model").glob("*.yaml"))


@pytest.mark.parametrize("model", MODELS)
def test_every_model_config_composes_and_validates(model):
    data = "text" if model.startswith("gpt2") else "synthetic_images"
    validate(train_config(composed(f"model={model}", f"data={data}")))


@pytest.mark.parametrize("full_size", ["resnet50", "vgg16", "gpt2_small"])
def test_full_size_variant_is_one_override_away(full_size):
    recipe = {"resnet50": "resnet", "vgg16": "vgg", "gpt2_small": "gpt2"}[full_size]
    cfg = composed(f"+recipe={recipe}", f"model={full_size}")
    validate(train_config(cfg))
    assert cfg.model.width == 64 or cfg.model.size == "small"


def test_the_configuration_is_converted_once_into_the_options_the_strategy_receives(tmp_path):
    """The launcher's composition and the YAML each rank loads back become the same typed `TrainConfig`,
    whose options objects the builders hand to the strategy as they are (the profile dir set on a copy)."""
    from commsched.cli.builders import build_strategy
    from commsched.cli.config import TrainConfig
    from commsched.options import FusionOptions, StreamOptions

    cfg = composed("schedule=dear", "fusion=fixed", "fusion.bucket_cap_mb=2", "streams.count=auto")
    train = train_config(cfg)
    assert isinstance(train, TrainConfig) and isinstance(train.fusion, FusionOptions)
    assert (
        isinstance(train.streams, StreamOptions) and train.streams.count == "auto" and train.fusion.bucket_cap_mb == 2.0
    )
    OmegaConf.save(cfg, tmp_path / "config.resolved.yaml", resolve=True)
    assert train_config(OmegaConf.load(tmp_path / "config.resolved.yaml")) == train
    strategy = build_strategy(train, tmp_path)
    assert strategy.options.fusion is train.fusion and strategy.options.streams is train.streams
    assert strategy.options.profile.dir == str(tmp_path / "profile") and train.profile.dir is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("fusion.bucket_cap_mb=-1", "fusion.bucket_cap_mb=-1.0; allowed: a number > 0"),
        ("model.arch=resnet51", "model.arch=resnet51; allowed: one of 'resnet18'"),
        ("data=digits model=gpt2", "for a language model one of ['synthetic_tokens', 'text']"),
        ("fusion.policy=greedy", "fusion.policy=greedy; allowed: one of 'auto', 'fixed', 'layers'"),
        ("schedule=ddp profile.steps=5", "profile.steps=5; allowed: 0 with schedule=ddp"),
        ("profile.steps=-1", "profile.steps=-1; allowed: an integer >= 0"),
        ("schedule=deft deft.capacity=-1", "deft.capacity=-1.0; allowed: a number > 0"),
        ("schedule=deft deft.measure_steps=0", "deft.measure_steps=0; allowed: an integer >= 1"),
        ("schedule=deft preserver.eps=2", "preserver.eps=2.0; allowed: a number in (0, 1)"),
        ("schedule=deft preserver.growth=1", "preserver.growth=1.0; allowed: a number > 1"),
        ("schedule=deft preserver.max_staleness=-1", "preserver.max_staleness=-1; allowed: an integer >= 0"),
        ("schedule=deft links.secondary_backend=mpi", "links.secondary_backend=mpi; allowed: one of 'gloo', 'nccl'"),
        (
            "schedule=deft deft.fallback=sometimes",
            "deft.fallback=sometimes; allowed: one of 'when_faster', 'when_undelayed', 'never'",
        ),
        ("schedule=deft deft.confirm_steps=-1", "deft.confirm_steps=-1; allowed: an integer >= 0"),
        (
            "schedule=wfbp compression=mstopk compression.density=2",
            "compression.density=2.0; allowed: a number in (0, 1]",
        ),
        (
            "schedule=wfbp compression.method=gzip",
            "compression.method=gzip; allowed: one of 'none', 'auto', 'topk', 'sampled', 'mstopk'",
        ),
        ("schedule=dear compression=mstopk", "compression.method=mstopk; allowed: 'none' with schedule dear"),
        ("schedule=ddp compression=topk", "compression.method=topk; allowed: none with schedule=ddp"),
        ("schedule=wfbp streams.count=17", 'streams.count=17; allowed: an integer 1..16 or "auto"'),
        ("schedule=dear streams.count=fast", 'streams.count=fast; allowed: an integer 1..16 or "auto"'),
        ("schedule=deft streams.count=4", "streams.count=4; allowed: 1 with schedule deft"),
        ("schedule=ddp streams.count=auto", "streams.count=auto; allowed: 1 with schedule=ddp"),
        (
            "schedule=wfbp streams.count=2 compression=topk",
            "streams.count=2; allowed: 1 with compression method 'topk'",
        ),
        (
            "schedule=wfbp streams.count=auto streams.budget_steps=0",
            "streams.budget_steps=0; allowed: an integer >= 1",
        ),
    ],
)
def test_bad_values_are_refused_with_allowed_values(override, message, hydra_syntax):
    """Named as the command line spells them (`commsched-train` renders refusals so)."""
    cfg = train_config(composed(*override.split()))
    with pytest.raises(CommSchedConfigError) as error:
        validate(cfg)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("schedule=fancy", "commsched: invalid schedule=fancy; allowed: one of 'ddp', 'wfbp', 'dear', 'deft'"),
        (
            "schedule.name=fancy",
            "commsched: invalid schedule.name=fancy; allowed: one of 'ddp', 'wfbp', 'dear', 'deft'",
        ),
        (
            "schedule=deft deft.timings_file=/nonexistent.json",
            "deft.timings_file=/nonexistent.json; allowed: an existing JSON file",
        ),
        ("compression.density=abc", "commsched: invalid compression.density=abc; allowed: a number in (0, 1]."),
        (
            "compression.density=0",
            "commsched: invalid compression.density=0.0; allowed: a number in (0, 1]. "
            "Fix: e.g. compression.density=0.01 (the default).",
        ),
        (
            "schedule=deft links.secondary_ifname=eth9",
            "commsched: invalid links.secondary_ifname=eth9; allowed: a network interface of this machine: lo",
        ),
        (
            "fusion.bucket_cap=3",
            "commsched: unknown key 'fusion.bucket_cap'; valid keys in fusion: policy, bucket_cap_mb",
        ),
        ("model.arch=resnet51", "allowed: one of 'resnet18', 'resnet34'"),
        ("data=cifar10 data.dir=/nonexistent", "does not hold CIFAR-10"),
    ],
)
def test_command_line_fails_before_any_worker_starts(tmp_path, override, message):
    proc = train(tmp_path, *override.split(), timeout=120)
    output = proc.stdout + proc.stderr
    ended_with_an_error(proc, status=2)
    assert message in output
    assert "Initializing distributed" not in output
    if override.startswith("schedule=fancy"):
        assert all(name in output for name in ("ddp", "wfbp", "dear"))


@pytest.mark.parametrize(
    "env, nodes, message",
    [
        ({"NODE_RANK": "1", "MASTER_PORT": "29555"}, 1, "NODE_RANK=1 is set but trainer.num_nodes=1"),
        ({}, 2, "trainer.num_nodes=2 needs NODE_RANK and MASTER_PORT set on every node"),
    ],
)
def test_a_launch_environment_that_cannot_form_the_run_is_refused_before_workers_start(tmp_path, env, nodes, message):
    """Each node of a cluster training alone (and ending "successfully"), or a multi-node run with no
    node rank, would otherwise start; commsched-train names what is missing instead."""
    clean = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commsched.cli.train",
            f"hydra.run.dir={tmp_path}/run",
            *QUIET,
            "trainer.devices=2",
            f"trainer.num_nodes={nodes}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**clean, **env},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Initializing distributed" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("resnet", ["model.width=4"]),
        ("vgg", ["model.width=4"]),
        ("gpt2", ["trainer.val_check_interval=8", "trainer.limit_val_batches=2"]),
    ],
)
def test_each_model_family_trains_on_two_processes(tmp_path, recipe, extra):
    proc = train(
        tmp_path,
        f"+recipe={recipe}",
        "trainer.max_steps=8",
        "data.train_size=256",
        "data.val_size=32",
        "profile.steps=4",
        "fusion=fixed",
        *extra,
    )  # the profile asked for, not a planner's
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = summary(tmp_path)
    assert result["world_size"] == 2 and result["steps"] == 8 and result["samples_per_s"] > 0
    assert result["exposed_comm_ms"] is not None
    assert "commsched: dear" in proc.stdout
    run = tmp_path / "run"
    assert (run / "config.resolved.yaml").is_file() and (run / "metrics.csv").is_file()
    logged = (run / "metrics.csv").read_text().splitlines()[0]
    assert "samples_per_s" in logged and "exposed_comm_ms" in logged
    assert "profile/overlap_ratio" in logged and "profile/exposed_comm_ms" in logged
    profile = json.loads((run / "profile" / "profile.json").read_text())
    assert profile["schedule"] == "dear" and profile["profiled_steps"] == 4
    assert (run / "profile" / "trace.json").is_file()


def test_sweep_collects_csv_table_and_chart(tmp_path):
    proc = train(
        tmp_path,
        "-m",
        "+recipe=resnet",
        "schedule=ddp,dear",
        "model.width=4",
        "trainer.max_steps=6",
        "data.train_size=128",
        "data.val_size=32",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sweep = tmp_path / "sweep"
    rows = (sweep / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith("schedule=ddp,ddp") and rows[2].startswith("schedule=dear,dear")
    assert (sweep / "sweep.png").stat().st_size > 5000
    assert "samples per s" in proc.stdout


def test_digits_with_dear_learns_and_matches_ddp(tmp_path):
    results = {}
    for schedule in ("ddp", "dear"):
        proc = train(
            tmp_path / schedule, "+recipe=digits", f"schedule={schedule}", "model.width=4", "trainer.max_epochs=3"
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[schedule] = summary(tmp_path / schedule)
    assert results["dear"]["val_acc"] > 0.6  # ten classes: chance is 0.1
    assert results["dear"]["train_loss"] == pytest.approx(results["ddp"]["train_loss"], rel=1e-3, abs=1e-4)
    assert results["dear"]["val_acc"] == pytest.approx(results["ddp"]["val_acc"], abs=0.01)


def test_digits_with_deft_learns_like_ddp_under_the_preserver(tmp_path):
    """Communication three times compute (a forced timings file): the Preserver enlarges the knapsacks
    until the walk says the plan converges like ddp; without it the plan delays far more."""
    timings = tmp_path / "timings.json"
    tmp_path.mkdir(parents=True, exist_ok=True)
    timings.write_text(json.dumps({"forward": 1.0, "backward": [1.0], "costs": [[3.0], [4.0]]}))  # one bucket
    common = [
        "+recipe=digits",
        "model.width=4",
        "trainer.max_epochs=3",
        f"deft.timings_file={timings}",
        "deft.warmup_steps=2",
        "deft.measure_steps=4",
    ]
    runs = {
        "ddp": ["schedule=ddp"],
        "deft": ["schedule=deft"],
        "unguarded": ["schedule=deft", "preserver.enabled=false", "deft.capacity=0.25"],
    }
    results = {}
    for name, overrides in runs.items():
        proc = train(tmp_path / name, *common, *overrides)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[name] = json.loads((tmp_path / name / "run" / "metrics.json").read_text())
    guarded, unguarded = results["deft"]["deft"], results["unguarded"]["deft"]
    assert guarded["preserver"] and guarded["preserver"][-1]["accepted"] and guarded["preserver"][-1]["staleness"] == 0
    assert max(unguarded["k"]) > max(guarded["k"]) or unguarded["n"] > guarded["n"]
    assert results["deft"]["val_acc"] > 0.6
    assert results["deft"]["val_acc"] == pytest.approx(results["ddp"]["val_acc"], abs=0.01)
