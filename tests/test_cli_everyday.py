"""The command lines as a daily user meets them, through the real console scripts: keys nothing
reads are refused before any worker starts, files are checked early with the field named, runs
checkpoint and resume exactly, say where their results went, and the console says no untruths."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import max_abs_diff, run_worker

BIN = Path(sys.executable).parent
QUIET = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
SMALL = ["+recipe=resnet", "model.width=4", "data.train_size=384", "data.val_size=32", "warmup_steps=0"]


def script(name: str, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def train(run_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return script(
        "commsched-train", f"hydra.run.dir={run_dir}", *QUIET, *overrides, cwd=run_dir.parent, timeout=timeout
    )


def refused_early(proc: subprocess.CompletedProcess, *needles: str) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    assert "Traceback" not in output and "Initializing distributed" not in output
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line that says what to change
    for needle in needles:
        assert needle in output, output
    return output


@pytest.mark.parametrize(
    "override, needles",
    [
        ("+fusion.bucket_cap=3", ["unknown key 'fusion.bucket_cap'", "bucket_cap_mb", "profile_steps"]),
        ("fusion.bucket_cap=3", ["unknown key 'fusion.bucket_cap'", "bucket_cap_mb"]),
        ("+ckpt_path=/nope.ckpt", ["unknown key 'ckpt_path'", "resume", "checkpoint"]),
        ("schedule=fancy", ["invalid schedule=fancy", "'ddp', 'wfbp', 'dear', 'deft'"]),
        ("fusion=greedy", ["invalid fusion=greedy", "Fix: did you mean fusion=mgwfbp-greedy?"]),
        ("comm_dtype=bf32", ["invalid comm_dtype=bf32", "'fp32', 'bf16', 'fp16'"]),
        ("+recipe=gpt2 data.path=/nonexistent", ["data.path=/nonexistent", "not found"]),
        ("resume=/nonexistent", ["resume=/nonexistent", "not found"]),
        ("trainer.max_steps=ten", ["invalid trainer.max_steps=ten", "an integer"]),
        ("fusion.bucket_cap_mb=big", ["invalid fusion.bucket_cap_mb=big", "allowed: a number > 0."]),
        ("trainer.enable_progress_bar=maybe", ["invalid trainer.enable_progress_bar=maybe", "true or false"]),
    ],
)
def test_bad_command_lines_are_refused_before_any_worker(tmp_path, override, needles):
    output = refused_early(train(tmp_path / "run", *override.split()), *needles)
    assert "schedule_schema" not in output and "fusion_schema" not in output


def test_plan_files_are_checked_before_any_worker(tmp_path):
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"policy": "mgwfbp", "world_size": 2, "buck')
    refused_early(train(tmp_path / "a", f"fusion.plan_file={truncated}"), "fusion.plan_file", "not a JSON plan")
    shaped = tmp_path / "shaped.json"
    shaped.write_text(json.dumps({"buckets": [["fc.weight"]]}))
    refused_early(
        train(tmp_path / "b", f"fusion.plan_file={shaped}"), "fusion.plan_file", "not a fusion plan", "policy"
    )
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps({"policy": "mgwfbp", "world_size": 2, "buckets": [["gpt.lm_head.weight", "gpt.wte.weight"]]})
    )
    refused_early(
        train(tmp_path / "c", *SMALL, f"fusion.plan_file={other}"),
        "fusion.plan_file",
        "parameter(s) this model does not have",
        "gpt.lm_head.weight",
    )


def test_a_run_stopped_at_step_k_and_resumed_equals_an_uninterrupted_one(tmp_path):
    """Every schedule, stopped mid-epoch (step 4 of 6) and at an epoch's end (step 6), resumed to step 9."""
    proc = run_worker("run_resume.py", str(tmp_path), "ddp", "wfbp", "dear")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "not resumable" not in proc.stdout + proc.stderr
    for schedule in ("ddp", "wfbp", "dear"):
        expected = torch.load(tmp_path / f"{schedule}-whole.pt")
        for stop in (4, 6):
            diff, key = max_abs_diff(torch.load(tmp_path / f"{schedule}-resumed{stop}.pt"), expected)
            assert diff <= 1e-5, f"{schedule} stopped at {stop}: {key} differs by {diff:.3g}"


def test_resume_takes_a_run_directory_from_the_command_line(tmp_path):
    common = [*SMALL, "schedule=dear"]
    first = tmp_path / "first"
    assert train(first, *common, "trainer.max_steps=4").returncode == 0
    resumed = train(tmp_path / "resumed", *common, "trainer.max_steps=9", f"resume={first}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert train(tmp_path / "whole", *common, "trainer.max_steps=9").returncode == 0
    got = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=False)
    expected = torch.load(tmp_path / "whole/checkpoints/last.ckpt", weights_only=False)
    assert got["global_step"] == 9 and "commsched" in got
    diff, key = max_abs_diff(got["state_dict"], expected["state_dict"])
    assert diff <= 1e-5, f"{key} differs by {diff:.3g}"


def test_a_run_says_where_its_results_went(tmp_path):
    run = tmp_path / "run"
    proc = train(run, *SMALL, "trainer.max_steps=4", "profile.steps=2", "trainer.enable_progress_bar=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert f"results in {run}" in output
    assert str(run / "profile" / "profile.json") in output and "overlap ratio" in output
    log = (run / "train.log").read_text()
    assert f"results in {run}" in log and "profile.json" in log
    assert (run / "checkpoints" / "last.ckpt").is_file()
    for untruth in ("Previous log files", "/-2", "Total FLOPs: 0", "💡 Tip"):
        assert untruth not in output, untruth
    overlap = [line.split(",") for line in (run / "metrics.csv").read_text().splitlines()]
    column = overlap[0].index("profile/overlap_ratio")
    ratios = [float(row[column]) for row in overlap[1:] if row[column]]
    assert ratios and all(0.0 <= r <= 1.0 for r in ratios)


def test_ctrl_c_ends_the_run_with_a_message_not_a_traceback(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [str(BIN / "commsched-train"), f"hydra.run.dir={run}", *QUIET, *SMALL, "trainer.max_steps=100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (run / "metrics.csv").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"still running 120 s after Ctrl-C; its output:\n{output[-6000:]}") from None
    assert proc.returncode == 130, output[-2000:]
    assert "interrupted" in output and "Traceback" not in output, output[-3000:]


def test_help_answers_without_torch_or_lightning():
    code = (
        "import sys, commsched_cli; sys.argv = ['commsched-train', '--help']\n"
        "try:\n    commsched_cli.train()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'heavy imports on --help'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "schedule: ddp, dear, deft, wfbp" in proc.stdout and "data: cifar10, digits" in proc.stdout
    assert "_schema" not in proc.stdout  # the typed schema nodes are how the config is checked, not choices


def test_compression_input_is_checked_without_torch():
    """Refused input answers at once, and nothing a Ctrl-C could interrupt inside torch's import runs."""
    code = (
        "import sys, commsched_cli\n"  # as the console scripts do: the package without torch
        "from hydra import compose, initialize_config_module\n"
        "from commsched.cli.config import register_configs, train_config, validate\n"
        "register_configs()\n"
        "with initialize_config_module(config_module='commsched.conf', version_base=None):\n"
        "    validate(train_config(compose(config_name='train', overrides=['schedule=wfbp', 'compression=mstopk'])))\n"
        "    try:\n"
        "        validate(train_config(compose(config_name='train', "
        "overrides=['schedule=dear', 'compression=mstopk'])))\n"
        "    except ValueError as error:\n"
        "        print(error)\n"
        "assert 'torch' not in sys.modules, 'torch imported while checking input'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CompressionOptions(method='mstopk'); allowed: 'none' with schedule dear" in proc.stdout


def test_the_catalogue_of_builtin_schedules_is_the_registry():
    """The names and traits the options are checked against before torch is imported are the registry's."""
    import commsched
    from commsched.options import BUILTIN, COMPRESSING_SCHEDULES, STRIPING_SCHEDULES

    builtin = {name: cls for name, cls in commsched.SCHEDULES.items() if cls.__module__.startswith("commsched.")}
    assert set(builtin) == set(BUILTIN)
    for name, traits in BUILTIN.items():
        assert (builtin[name].compresses, builtin[name].stripes) == (traits.compresses, traits.stripes), name
    assert COMPRESSING_SCHEDULES == tuple(n for n in BUILTIN if commsched.SCHEDULES[n].compresses)
    assert STRIPING_SCHEDULES == tuple(n for n in BUILTIN if commsched.SCHEDULES[n].stripes)


def test_bench_help_lists_only_its_own_options(tmp_path):
    proc = script("commsched-bench", "--help", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0
    for training_group in ("schedule:", "fusion:", "trainer:", "recipe"):
        assert training_group not in proc.stdout
    assert "models:" in proc.stdout and "rounds:" in proc.stdout


def test_the_python_api_writes_its_plan_to_default_root_dir(cases):
    """The planners' runs (workers/run_cases.py) set default_root_dir: the plan lands there, nowhere else."""
    directory = Path(cases(3).directory)
    assert (directory / "dear-mgwfbp" / "commsched_plan.json").is_file()
    assert (
        not (directory / "commsched_plan.json").exists()
        and not (Path(__file__).parent / "workers" / "commsched_plan.json").exists()
    )


def test_no_file_of_the_project_cites_a_file_outside_the_repository():
    """The README, the docs, the examples, the code, the tests and the recipes stand on their own: a reader has no
    notes or papers folder beside the repository."""
    root = Path(__file__).parents[1]
    outside = ("papers" + "/", "DESIGN" + ".md")  # spelt apart so that this file does not cite them
    files = [
        root / "README.md",
        *(
            p
            for folder in ("src", "tests", "recipes", "docs", "examples")
            for p in (root / folder).rglob("*")
            if p.suffix in (".py", ".md", ".yaml", ".sh")
        ),
    ]
    citing = [f"{p.relative_to(root)}: {name}" for p in files for name in outside if name in p.read_text()]
    assert citing == []


def test_the_summary_says_which_plan_ran_and_how_far_its_prediction_was(tmp_path):
    planned = tmp_path / "planned"
    proc = train(
        planned,
        *SMALL,
        "schedule=dear",
        "fusion=mgwfbp",
        "fusion.profile_steps=2",
        "fusion.profile_warmup_steps=1",
        "trainer.max_steps=8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((planned / "summary.json").read_text())
    assert summary["fusion"].startswith("mgwfbp decided (mgwfbp plan)") and summary["bucket_cap_mb"] is None
    assert summary["predicted_step_ms"] > 0
    assert "the plan's model predicted" in proc.stdout + proc.stderr and "measured" in proc.stdout + proc.stderr

    plan = planned / "commsched_plan.json"
    loaded = tmp_path / "loaded"
    proc = train(loaded, *SMALL, "schedule=dear", f"fusion.plan_file={plan}", "trainer.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((loaded / "summary.json").read_text())
    buckets = len(json.loads(plan.read_text())["buckets"])
    assert summary["fusion"] == f"plan_file {plan} (mgwfbp plan), {buckets} buckets", summary["fusion"]
    assert summary["bucket_cap_mb"] is None


def test_one_version_number():
    from importlib.metadata import version

    import commsched

    assert version("commsched") == commsched.__version__


def test_more_cpu_workers_than_cores_warns_once(tmp_path):
    cores = len(os.sched_getaffinity(0))
    if cores + 1 > 4:
        pytest.skip(f"{cores} cores: a run with more workers than that is too large for the suite")
    proc = train(tmp_path / "run", *SMALL, f"trainer.devices={cores + 1}", "trainer.max_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "CPU workers on" in line]
    assert len(warnings) == 1 and f"trainer.devices={cores + 1}" in warnings[0], proc.stderr[-2000:]


def test_import_commsched_loads_neither_torch_nor_lightning_and_the_names_still_resolve():
    """The strategies are registered when Lightning loads, whichever comes first."""
    code = (
        "import sys, commsched\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'heavy imports on import commsched'\n"
        "import lightning.pytorch as pl\n"
        "trainer = pl.Trainer(strategy='dear', accelerator='cpu', devices=1, logger=False)\n"
        "assert type(trainer.strategy).__name__ == 'DeARStrategy', type(trainer.strategy)\n"
        "assert not [f for f in sys.meta_path if 'commsched' in type(f).__module__ "
        "and 'registration' in type(f).__module__]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    late = subprocess.run(
        [
            sys.executable,
            "-c",
            "import lightning.pytorch as pl, commsched\n"
            "from lightning.pytorch.strategies import StrategyRegistry\nassert 'topk' in StrategyRegistry",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert late.returncode == 0, late.stderr[-2000:]
