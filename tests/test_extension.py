"""A schedule is one file: `examples/custom_schedule.py`, defined outside the package and registered with
`commsched.register_schedule`, runs by name from Python (Trainer(strategy=...)) and from Hydra
(plugins=, schedule=), is profiled, benchmarked and simulated, and equals ddp. Registering refuses
what cannot work, with the field and the allowed values."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import max_abs_diff

EXAMPLE = Path(__file__).parent.parent / "examples" / "custom_schedule.py"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("extension")
    (directory / "after_backward.py").write_text(
        EXAMPLE.read_text()
    )  # a module name of its own, outside the repository
    return directory


def run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_from_python_by_name_equal_to_ddp(example):
    """The example itself: Trainer(strategy="after_backward") next to Trainer(strategy="ddp")."""
    proc = run([sys.executable, "after_backward.py"], example)
    differences = re.findall(r"(by name|in_flight=2): largest difference from ddp: (\S+)", proc.stdout)
    assert [label for label, _ in differences] == ["by name", "in_flight=2"], proc.stdout
    assert all(float(difference) <= 1e-5 for _, difference in differences)
    assert (
        "commsched after_backward: 2 bucket all-reduce(s) in flight at once" in proc.stdout + proc.stderr
    )  # its own option arrived


def test_from_hydra_by_name_profiled_equal_to_ddp(example):
    common = [
        "plugins=[after_backward]",
        "model=small_cnn",
        "model.width=8",
        "data.batch_size=8",
        "data.train_size=64",
        "trainer.max_steps=6",
        "trainer.enable_progress_bar=false",
        "fusion.bucket_cap_mb=0.01",
    ]
    proc = run(
        [
            str(BIN / "commsched-train"),
            *common,
            "schedule=after_backward",
            "after_backward.in_flight=1",
            "profile.steps=3",
            "hydra.run.dir=mine",
        ],
        example,
    )
    assert (
        "commsched after_backward: 1 bucket all-reduce(s) in flight at once" in proc.stdout + proc.stderr
    )  # its own node
    run([str(BIN / "commsched-train"), *common, "schedule=ddp", "hydra.run.dir=ddp"], example)
    mine = torch.load(example / "mine" / "checkpoints" / "last.ckpt", weights_only=False)
    theirs = torch.load(example / "ddp" / "checkpoints" / "last.ckpt", weights_only=False)
    assert mine["commsched"]["schedule"] == "after_backward"
    diff, key = max_abs_diff(mine["state_dict"], theirs["state_dict"])
    assert diff <= 1e-5, f"{key} differs by {diff:.3g}"
    profile = json.loads((example / "mine" / "profile" / "profile.json").read_text())
    summary = profile["summary"]
    assert profile["schedule"] == "after_backward"
    assert summary["theoretical_best_s"]["after_backward"] == pytest.approx(
        summary["t_ff"] + summary["t_bp"] + summary["t_ar"]
    )


def test_benchmarked_and_simulated_by_name(example):
    run(
        [
            str(BIN / "commsched-bench"),
            "plugins=[after_backward]",
            "schedules=[ddp,after_backward]",
            "width=8",
            "steps=2",
            "warmup=1",
            "rounds=1",
            "hydra.run.dir=bench",
        ],
        example,
    )
    rows = json.loads((example / "bench" / "results.json").read_text())[0]["rows"]
    assert [r["schedule"] for r in rows] == ["ddp", "after_backward"] and rows[1]["weights_vs_ddp"] <= 1e-5
    proc = run(
        [
            str(BIN / "commsched-simulate"),
            "--plugins",
            "after_backward",
            "--schedules",
            "syncea,after_backward",
            "--workers",
            "2",
            "--bucket-mb",
            "1000",
        ],
        example,
    )
    cells = re.search(r"│\s+2 │\s+([\d.]+) \(.*?\) │\s+([\d.]+) \(", proc.stdout)
    assert cells and cells.group(1) == cells.group(2), proc.stdout  # one bucket after backward: SyncEASGD's timeline


def test_registering_refuses_what_cannot_work():
    import commsched
    from commsched import CommSchedConfigError

    class NoName(commsched.Schedule):
        pass

    class Unknown(commsched.Schedule):
        name = "unknown_collective"
        step_collectives = ("all_to_all",)

    class Unlinked(commsched.Schedule):
        name = "unknown_link"
        links_used = ("primary", "rdma")

    class Hookless(commsched.Schedule):
        name = "hookless"

    with pytest.raises(CommSchedConfigError, match="not a subclass of commsched.Schedule"):
        commsched.register_schedule(object)
    with pytest.raises(CommSchedConfigError, match=r"NoName.name = 'base'.*other than ddp, base"):
        commsched.register_schedule(NoName)
    with pytest.raises(CommSchedConfigError, match=r"step_collectives has \['all_to_all'\]; allowed: all_reduce"):
        commsched.register_schedule(Unknown)
    with pytest.raises(
        CommSchedConfigError, match=r"links_used has \['rdma'\]; allowed: primary, secondary, intra, inter"
    ):
        commsched.register_schedule(Unlinked)
    with pytest.raises(CommSchedConfigError, match="Hookless does not implement on_bucket_ready and on_backward_end"):
        commsched.register_schedule(Hookless)
    assert set(commsched.SCHEDULES) >= {"wfbp", "dear", "deft"}
