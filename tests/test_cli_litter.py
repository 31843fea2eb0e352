"""What the command-line tools leave behind and say: a configuration commsched-train refuses leaves
no run folder (single runs and -m sweeps), while anything that was there before or that another
run wrote stays; `--help` starts by saying what commsched-train does; its own messages all start
"commsched:"; a cluster whose command fails says which node failed, how, and where its output is."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from commsched.cluster import netns

BIN = Path(sys.executable).parent
QUIET = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
TINY = [
    "model=small_cnn",
    "model.width=4",
    "data.train_size=16",
    "data.val_size=8",
    "data.batch_size=4",
    "warmup_steps=0",
    "trainer.limit_val_batches=0",
    "trainer.devices=1",
    "trainer.max_steps=1",
    "checkpoint.enabled=false",
]
REFUSED = "fusion.bucket_cap_mb=-1"


def train(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [str(BIN / "commsched-train"), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def refused(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bucket_cap_mb" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_refused_config_leaves_no_run_folder(tmp_path):
    refused(train(tmp_path, *QUIET, REFUSED))
    assert tree(tmp_path) == []  # no outputs/<date>/<time>/.hydra, no empty train.log, no outputs/


def test_a_refused_sweep_leaves_no_sweep_folder(tmp_path):
    refused(train(tmp_path, "-m", *QUIET, "fusion.bucket_cap_mb=-1,2"))
    assert tree(tmp_path) == []


def test_what_was_there_before_stays(tmp_path):
    """Earlier runs' folders, a folder the command line names that already holds something, and the
    parents a refused run did not make are kept; only what Hydra made for the refused run goes."""
    earlier = tmp_path / "outputs" / "2000-01-01" / "00-00-00"
    earlier.mkdir(parents=True)
    (earlier / "train.log").write_text("")  # even an earlier run's empty log: not this run's
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = tree(tmp_path)
    refused(train(tmp_path, *QUIET, REFUSED))
    assert tree(tmp_path) == before
    refused(train(tmp_path, *QUIET, REFUSED, f"hydra.run.dir={mine}"))
    assert (mine / "notes.txt").read_text() == "keep me"
    refused(train(tmp_path, *QUIET, REFUSED, "hydra.run.dir=new/deeper/run"))
    assert not (tmp_path / "new").exists()  # every folder of a literal hydra.run.dir that the run made goes
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(train(tmp_path, *QUIET, REFUSED, "hydra.run.dir=empty"))
    assert empty.is_dir() and tree(empty) == []  # named and there before: kept, emptied of Hydra's files


def test_a_sweep_job_refused_after_one_that_ran_keeps_the_finished_job(tmp_path):
    proc = train(tmp_path, "-m", *QUIET, *TINY, "hydra.sweep.dir=sweep", "fusion.bucket_cap_mb=2,-1")
    refused(proc)
    assert (tmp_path / "sweep" / "0" / "metrics.json").is_file()
    assert (tmp_path / "sweep" / "multirun.yaml").is_file()
    assert not (tmp_path / "sweep" / "1").exists()


def test_help_starts_by_saying_what_commsched_train_does():
    proc = subprocess.run([str(BIN / "commsched-train"), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.split("\n\n")[0]
    assert first.startswith("commsched-train trains a model"), proc.stdout[:500]
    assert "Lightning's own ddp" in first and "trainer.devices=N" in first
    assert (
        "commsched-train schedule=dear model=resnet trainer.devices=2"
        in proc.stdout.split("== Configuration groups ==")[0]
    )
    assert "train is powered by Hydra" not in proc.stdout.replace("commsched-train is powered", "")
    assert "schedule: ddp, dear, deft, wfbp" in proc.stdout  # Hydra's help follows


def test_commsched_train_says_commsched_before_each_of_its_messages(tmp_path, capsys):
    from commsched.cli import train as train_module

    after_docstring = inspect.getsource(train_module).split('"""', 2)[2]
    assert "commsched-train:" not in after_docstring  # no message of its own with the other prefix
    train_module._warned.clear()
    cores = len(os.sched_getaffinity(0))
    train_module.warn_if_oversubscribed(SimpleNamespace(trainer=SimpleNamespace(accelerator="cpu", devices=cores + 1)))
    assert capsys.readouterr().err.startswith("commsched: warning: trainer.devices=")

    broken = tmp_path / "broken.ckpt"
    broken.write_text("not a checkpoint")
    proc = train(tmp_path, *QUIET, *TINY, f"hydra.run.dir={tmp_path / 'run'}", f"resume={broken}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "commsched: the training run failed (exit code 1)" in proc.stderr, proc.stderr[-3000:]
    assert "commsched-train:" not in proc.stderr


needs_root = pytest.mark.skipif(
    netns.unavailable_reason() is not None, reason=f"no emulated cluster here: {netns.unavailable_reason()}"
)


def cluster(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "commsched-cluster"), "--nodes", "2", "--rate", "100mbit", "--grace", "2", "--", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_root
def test_a_cluster_whose_command_fails_says_which_node_and_how():
    proc = cluster("false")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "commsched-cluster: the command failed on node 0 (exit code 1; it printed nothing) "
        "and node 1 (exit code 1; it printed nothing)"
    ), lines[0]

    proc = cluster("sh", "-c", 'if [ "$NODE_RANK" = 1 ]; then echo broken; exit 7; fi; sleep 60')
    assert proc.returncode == 7
    assert "[node 1] broken" in proc.stdout
    assert proc.stderr.strip() == (
        "commsched-cluster: the command failed on node 1 (exit code 7; its output is above, "
        "on the lines starting [node 1]); node 0 was stopped after the 2 s grace (--grace)"
    )

    proc = cluster("true")
    assert proc.returncode == 0 and proc.stderr == ""
