"""Ctrl-C as a user presses it: a real SIGINT to the whole process group of a multi-process run.

The first one stops every rank at one step and saves a checkpoint that resumes exactly (pending
communication included); a second one stops at once; before training starts, or in the benchmark,
it ends the command with one line and exit code 130, never a traceback. A run ends with one
`last.ckpt`, at its final step, even when checkpoints follow a step cadence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from conftest import max_abs_diff, run_worker

BIN = Path(sys.executable).parent
QUIET = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
SMALL = [
    "+recipe=resnet",
    "model.width=4",
    "data.train_size=384",
    "data.val_size=32",
    "warmup_steps=0",
    "schedule=dear",
]


def start(run_dir: Path, *overrides: str, program: str = "commsched-train") -> subprocess.Popen:
    """In a session of its own, as a terminal's foreground job is: killpg reaches every process of it."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    quiet = QUIET if program == "commsched-train" else []
    return subprocess.Popen(
        [str(BIN / program), f"hydra.run.dir={run_dir}", *quiet, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=run_dir.parent,
        start_new_session=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def finish(proc: subprocess.Popen) -> tuple[str, list[str]]:
    """The output, and what the run said of its end on stderr (Lightning's warnings aside)."""
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, (out + err)[-3000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, (out + err)[-3000:]
    return out, [line for line in err.splitlines() if line.startswith("commsched")]


def train(run_dir: Path, *overrides: str) -> None:
    proc = subprocess.run(
        [str(BIN / "commsched-train"), f"hydra.run.dir={run_dir}", *QUIET, *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=run_dir.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ctrl_c_saves_at_a_step_every_rank_agrees_on_and_the_run_resumes_exactly(tmp_path):
    run = tmp_path / "interrupted"
    proc = start(run, *SMALL, "trainer.max_steps=100000")
    wait_for(run / "checkpoints" / "last.ckpt", proc)  # the first epoch (6 steps) ended: mid-epoch 2 is next
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, said = finish(proc)
    assert "SIGINT received" in out
    assert len(said) == 1 and "stopped at step" in said[0] and f"resume={run}" in said[0], said
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    stopped = saved["global_step"]
    assert f"stopped at step {stopped} " in said[0] and stopped > 6 and "commsched" in saved

    end = stopped + 3
    train(tmp_path / "resumed", *SMALL, f"trainer.max_steps={end}", f"resume={run}")
    train(tmp_path / "whole", *SMALL, f"trainer.max_steps={end}")
    for folder in (run, tmp_path / "resumed", tmp_path / "whole"):  # one `last`, no `last-v1.ckpt` beside it
        assert [p.name for p in (folder / "checkpoints").glob("last*.ckpt")] == ["last.ckpt"], folder
    got = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=False)
    expected = torch.load(tmp_path / "whole/checkpoints/last.ckpt", weights_only=False)
    assert got["global_step"] == expected["global_step"] == end
    diff, key = max_abs_diff(got["state_dict"], expected["state_dict"])
    assert diff <= 1e-5, f"{key} differs by {diff:.3g} after resuming from step {stopped}"
    momenta = [
        {f"{i}.{name}": t for i, entry in c["optimizer_states"][0]["state"].items() for name, t in entry.items()}
        for c in (got, expected)
    ]
    diff, key = max_abs_diff(*momenta)
    assert diff <= 1e-5, f"optimizer state {key} differs by {diff:.3g}"


def test_ctrl_c_inside_a_metrics_collective_still_stops_every_rank_at_one_step(tmp_path):
    """The signal handler runs wherever the main thread is, here between the collectives of Lightning's
    metric synchronisation on rank 0; what it does must start no collective of its own (a
    `ModelCheckpoint` monitoring that metric names its file from the metrics), or the ranks wait for
    each other until the process group's timeout."""
    proc = run_worker("run_signal_in_sync.py", str(tmp_path), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = [torch.load(tmp_path / f"result.rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert results[0]["fired"], "the signal was never sent: the test did not test"
    stopped = [r["stopped"] for r in results]
    assert stopped[0] is not None and stopped[0] == stopped[1], stopped
    assert Path(stopped[0]["saved"]).is_file()
    assert torch.load(stopped[0]["saved"], weights_only=False)["global_step"] == stopped[0]["step"]
    assert (
        f"SIGINT received: stopping at the next step every rank reaches and saving {tmp_path / 'ckpt'}" in proc.stdout
    )


def test_a_command_rank_whose_shutdown_hangs_ends_itself_with_a_line():
    """Lightning ignores Ctrl-C while it shuts down after one: a rank of a command whose shutdown waits
    on a peer (here: sleeps) ends by itself, with exit code 130 and one line, and never sooner."""
    code = (
        "import time\n"
        "from commsched.runtime.interrupt import end_if_shutdown_hangs\n"
        "started = time.monotonic()\n"
        "end_if_shutdown_hangs(lambda: 'the last checkpoint is here.ckpt', 1.0)\n"
        "print('shutting down', flush=True)\n"
        "try:\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    print(f'ended after {time.monotonic() - started:.1f} s', flush=True)\n"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stdout == "shutting down\n"  # ended at once: no `finally` ran
    assert proc.stderr == (
        "commsched: interrupted at once, without saving (the shutdown did not end within 1 s); "
        "the last checkpoint is here.ckpt\n"
    )
    assert 1.0 <= took < 30  # never sooner; the import is most of the rest


def test_a_second_signal_guards_a_command_lines_shutdown_and_nothing_else(tmp_path, monkeypatch):
    """Under `commsched-train` (command_line=True) the second signal starts the guard above; a Python
    session's fit (a notebook's kernel) is never ended by it."""
    from commsched.runtime import interrupt

    for command_line in (True, False):
        guarded = []
        monkeypatch.setattr(interrupt, "end_if_shutdown_hangs", lambda say: guarded.append(say()))
        stopper = interrupt.StopAndSave(dirpath=tmp_path, command_line=command_line)
        stopper._install()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert guarded == []  # the first signal stops at an agreed step: nothing to guard
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass
            else:
                raise AssertionError("a second Ctrl-C did not stop at once")
        finally:
            stopper._restore()
        assert guarded == (["no checkpoint was saved in this fit"] if command_line else []), guarded


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
    run = tmp_path / "run"
    proc = start(run, *SMALL, "trainer.max_steps=100000")
    wait_for(run / "checkpoints" / "last.ckpt", proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, said = finish(proc)
    assert len(said) == 1 and "at once, without saving" in said[0] and "last.ckpt" in said[0], said


def test_a_sigterm_arriving_twice_is_one_stop_and_a_later_signal_a_second(tmp_path, capsys):
    """A scheduler or a cluster's launcher signals the process group: every rank gets SIGTERM, and
    commsched-train forwards its own copy, which may land after the first was handled. That copy is
    the same request to stop (the run still saves); a signal after the window is a second one."""
    from commsched.runtime.interrupt import SAME_SIGTERM_S, StopAndSave

    stopper = StopAndSave(dirpath=tmp_path)
    stopper._install()
    try:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        except KeyboardInterrupt:
            raise AssertionError("the second copy of one SIGTERM stopped the run at once, without saving") from None
        assert stopper.signals_seen == 1
        assert capsys.readouterr().out.count("SIGTERM received") == 1
        time.sleep(SAME_SIGTERM_S)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("a SIGTERM after the window did not stop at once")
    finally:
        stopper._restore()


def test_ctrl_c_while_starting_is_one_line(tmp_path):
    for delay in (1.0, 4.0):  # while Hydra composes / while the run imports and starts its workers
        proc = start(tmp_path / f"run{delay}", *SMALL, "trainer.max_steps=100000")
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        _, said = finish(proc)
        assert len(said) <= 1, said


def test_a_run_with_a_step_cadence_ends_with_one_last_at_its_final_step(tmp_path):
    """6 steps an epoch, a cadence of 100 steps that never comes: StopAndSave saves `last.ckpt` at the
    epoch's end and at the final step, through the ModelCheckpoint: no `last-v1.ckpt` beside it."""
    run = tmp_path / "run"
    train(run, *SMALL, "trainer.max_steps=8", "checkpoint.every_n_steps=100")
    assert [p.name for p in (run / "checkpoints").glob("*.ckpt")] == ["last.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 8


def test_ctrl_c_in_the_benchmark_is_one_line_and_leaves_no_namespace(tmp_path):
    proc = start(tmp_path / "bench", "link.rate=1gbit", "steps=50", "rounds=3", program="commsched-bench")
    time.sleep(12)  # the workers train inside the namespace by now
    os.killpg(proc.pid, signal.SIGINT)
    _, said = finish(proc)
    assert said == ["commsched: interrupted"], said  # every command's own messages start "commsched:"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"commsched-{proc.pid}-" not in namespaces
