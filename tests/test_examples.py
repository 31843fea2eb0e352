"""Every script in `examples/` runs as its header says, with small settings; the custom schedule's
own tests are in test_extension.py (it is the file those tests load)."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"
BIN = Path(sys.executable).parent


def run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # as with the venv activated
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def final_metrics(output: str, strategy: str) -> tuple[float, float]:
    found = re.search(rf"{strategy}: val_acc (\S+), val_loss (\S+) after (\d+) steps", output)
    assert found, output[-3000:]
    return float(found.group(1)), float(found.group(2))


def test_every_example_is_tested():
    tested = {
        "train_with_dear.py",
        "gan.py",
        "fabric_gpt2.py",
        "custom_schedule.py",
        "hydra_sweep.sh",
        "emulated_cluster.sh",
    }
    assert {p.name for p in EXAMPLES.iterdir() if p.is_file()} == tested


def test_the_lightning_script_trains_under_dear_as_under_ddp(tmp_path):
    """The user's own module, data and callback; `strategy="dear"` ends where Lightning's ddp ends."""
    ends = {}
    for strategy in ("ddp", "dear"):
        proc = run(
            [sys.executable, str(EXAMPLES / "train_with_dear.py"), "--strategy", strategy, "--max-steps", "8"], tmp_path
        )
        ends[strategy] = final_metrics(proc.stdout, strategy)
    assert ends["dear"] == ends["ddp"]
    assert (tmp_path / "outputs" / "train_with_dear").is_dir()


def test_the_gan_trains_by_hand_under_dear_as_under_ddp(tmp_path):
    """Two optimizers stepped by hand: the same weights (a checksum printed to six decimals) as Lightning's ddp."""
    sums = {}
    for strategy in ("ddp", "dear"):
        proc = run([sys.executable, str(EXAMPLES / "gan.py"), "--strategy", strategy, "--batches", "6"], tmp_path)
        found = re.search(rf"{strategy}: \S+ ms a batch .* weights checksum (\S+)", proc.stdout)
        assert found, proc.stdout[-3000:]
        sums[strategy] = found.group(1)
    assert sums["dear"] == sums["ddp"]
    assert (
        "so WFBP (DDP's schedule, exact with any number of optimizers) runs every iteration"
        in proc.stderr + proc.stdout
    )


def test_the_fabric_loop_trains_under_dear_as_under_ddp_and_resumes_exactly(tmp_path):
    """A hand-written Fabric loop: dear ends where Fabric's ddp ends, and a run stopped after `fabric.save`
    and continued with `--resume` in new processes ends where the uninterrupted run ends."""
    script = str(EXAMPLES / "fabric_gpt2.py")
    last = lambda proc: proc.stdout.strip().splitlines()[-1].split(": ", 1)[1]  # noqa: E731
    ends = {s: last(run([sys.executable, script, "--strategy", s, "--steps", "4"], tmp_path)) for s in ("ddp", "dear")}
    # "loss L, weight sum W after N steps": dear clips by the norm of its shards, whose sum can differ from
    # torch's in the last bit, and so can a sum of about 1,100 over every weight in the sixth decimal
    (loss, total), (ddp_loss, ddp_total) = (map(float, re.findall(r"-?\d+\.\d+", ends[s])) for s in ("dear", "ddp"))
    assert abs(loss - ddp_loss) <= 1e-5 and abs(total - ddp_total) <= 1e-4, ends
    assert ends["dear"].rsplit(" after ", 1)[1] == ends["ddp"].rsplit(" after ", 1)[1], ends  # the same steps
    run([sys.executable, script, "--steps", "2", "--save", "half.ckpt"], tmp_path)
    resumed = last(run([sys.executable, script, "--steps", "4", "--resume", "half.ckpt"], tmp_path))
    assert resumed == ends["dear"]


def test_the_hydra_sweep_collects_one_row_per_schedule(tmp_path):
    sweep = tmp_path / "sweep"
    run(
        [
            str(EXAMPLES / "hydra_sweep.sh"),
            "trainer.max_steps=3",
            "trainer.max_epochs=1",
            "trainer.enable_progress_bar=false",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    with open(sweep / "sweep.csv") as table:
        rows = list(csv.DictReader(table))
    assert sorted(row["schedule"] for row in rows) == ["ddp", "dear", "wfbp"], rows


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="the emulated cluster needs root and iproute2"
)
def test_the_cluster_example_runs_the_script_as_two_nodes(tmp_path):
    proc = run([str(EXAMPLES / "emulated_cluster.sh"), "--max-steps", "4"], tmp_path)
    output = proc.stdout + proc.stderr
    assert "[node 0]" in output and "[node 1]" in output
    assert re.search(r"dear: val_acc \S+, val_loss \S+ after 4 steps", output), output[-3000:]
