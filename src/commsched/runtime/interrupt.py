"""Ctrl-C (or SIGTERM) stops a run at a step every rank agrees on, with a checkpoint to resume from.

A signal reaches the ranks at different moments: one may be inside a step's collectives while
another has finished it. Saving there would mix steps, and a checkpoint needs every rank (the
communication state is gathered to rank 0). So the first signal only asks for a stop: at its next
step end the rank that saw it posts a stop step two steps ahead in the job's key-value store (ranks
cannot drift further apart than one step, since every step's collectives need them all); every
rank reads the store at each step end, and at that step all of them save `last.ckpt` (pending
communication applied first, delayed gradients included) and raise `StoppedBySignal` together,
which ends the fit as an interruption: not as `trainer.should_stop` would, which runs the epoch-end
hooks (validation, `ModelCheckpoint`'s epoch save) as if the epoch had ended. A second signal stops
at once, without saving.

Failures are not saved: a failing rank's peers may be inside a collective it will never join, so
the last checkpoint of a failed run is the latest epoch-end or step checkpoint.
"""

from __future__ import annotations

import io
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from commsched import run_files

log = logging.getLogger(__name__)

STOP_KEY = "commsched/stop_at_step"
AHEAD = 2
"""Steps between the signal being seen and the agreed stop: ranks are at most one step apart."""
SAME_SIGTERM_S = 1.0
"""A SIGTERM this soon after another is the same stop arriving twice (the process group's and the
launcher's forwarded copy), not a second request to stop at once."""
SHUTDOWN_S = 20.0
"""How long a command-line rank's shutdown after an interrupt may take before the process ends at once."""


def end_if_shutdown_hangs(last_checkpoint: Callable[[], str], seconds: float = SHUTDOWN_S) -> None:
    """For a command's rank process: end it (exit code 130) if the shutdown an interrupt started has not
    finished within `seconds`, saying `last_checkpoint()` (where the user's training is). Lightning
    ignores Ctrl-C during parts of its shutdown after one, and a rank whose peer was interrupted in the middle of
    a collective can wait there until the process group's timeout: the user must never have to find and
    kill the processes. Not for a Python session: a notebook's kernel is not ours to end."""

    def end() -> None:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            line = (
                f"commsched: interrupted at once, without saving (the shutdown did not end within {seconds:g} s); "
                f"{last_checkpoint()}\n"
            )
            os.write(2, line.encode())
        os._exit(130)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # no thread to be had: the shutdown goes on unguarded, the interrupt still raised
        pass


class StoppedBySignal(SystemExit):
    """Raised on every rank at the agreed step, after the checkpoint is written: exit code 130, as a shell gives
    Ctrl-C."""

    def __init__(self, step: int, saved: Path) -> None:
        super().__init__(130)
        self.step, self.saved = step, saved

    def __str__(self) -> str:
        return f"stopped at step {self.step}; saved {self.saved}"


class StopAndSave(pl.Callback):
    """Saves the run's last checkpoint at the end of every training epoch, at the end of the fit, and
    at the step every rank agrees on when the run is interrupted (Ctrl-C, SIGTERM).

    One `last` file: with a `ModelCheckpoint(save_last=True)` in the Trainer, that callback owns it,
    and this one saves through it (its file name, its `last_model_path`, its folder), so Lightning's
    version counter never adds a `last-v1.ckpt` beside it; an epoch end or a step the
    `ModelCheckpoint` already saved is not saved again. Without one (or given another `dirpath` or
    `filename` than its), the file is `dirpath/filename`.
    The checkpoint left at the end of a fit is that of its final step.

    A run resumed into a new folder (a new logger version, a new `commsched-train` run directory)
    starts the `ModelCheckpoint`'s bookkeeping afresh, as Lightning does, without its warning that
    the folder changed.

    Args:
        dirpath: where the checkpoint goes; default: the Trainer's `ModelCheckpoint` folder, else the
            run's folder's `checkpoints` (the logger's folder under a commsched strategy, else
            `default_root_dir`), found when the first save is due, once every callback is set up.
        filename: the checkpoint's file name; default: the `ModelCheckpoint`'s `last` name, else
            `last.ckpt` (what `commsched-train resume=<run dir>` reads).
        every_epoch: also save at each epoch end: Lightning's `ModelCheckpoint(save_last=True)` writes
            `last` only beside a checkpoint of its own, so with no monitor, or a step cadence, a run
            could end an epoch with nothing to resume from.
        command_line: set by `commsched-train`: `resume_hint` names `commsched-train resume=<run dir>`,
            and the command prints its own line when the run is interrupted.
    """

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        filename: Optional[str] = None,
        every_epoch: bool = True,
        command_line: bool = False,
    ) -> None:
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename
        self.every_epoch = every_epoch
        self.command_line = command_line
        self.signals_seen = 0
        self._last_sigterm = -math.inf
        self.stopped_at: Optional[int] = None
        """The step the run stopped at on a signal (None: it was not interrupted)."""
        self.saved: Optional[Path] = None
        """The checkpoint written at the stop."""
        self.last_saved: Optional[Path] = None
        """The last checkpoint of this fit (written by this callback or by the `ModelCheckpoint` it saves through)."""
        self.last_step: Optional[int] = None
        """The step of `last_saved`."""
        self._trainer: Optional[pl.Trainer] = None
        self._stop_at: Optional[int] = None
        self._posted = False
        self._step_at_batch_start = 0
        self._previous: dict[int, Any] = {}

    # ------------------------------------------------------------------ where
    def _owner(self, trainer: Optional[pl.Trainer]) -> Optional[ModelCheckpoint]:
        """The `ModelCheckpoint` that writes `last` and that this callback saves through, if any."""
        if trainer is None:
            return None
        for callback in trainer.checkpoint_callbacks:
            if not (isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath is not None):
                continue
            same_folder = self.dirpath is None or Path(callback.dirpath).resolve() == self.dirpath.resolve()
            same_name = self.filename in (None, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
            if same_folder and same_name:
                return callback
        return None

    def _folder(self, trainer: Optional[pl.Trainer]) -> Path:
        if self.dirpath is not None:
            return self.dirpath
        if trainer is None:
            return Path("checkpoints")  # not set up yet: only a signal before fit asks
        chosen = trainer.checkpoint_callback
        found = getattr(chosen, "dirpath", None)
        return (
            Path(found) if found else (run_files.folder_of(trainer) or Path(trainer.default_root_dir)) / "checkpoints"
        )

    @property
    def path(self) -> Path:
        """Where the next save goes (the `ModelCheckpoint`'s `last` when it owns it)."""
        trainer = self._trainer
        owner = self._owner(trainer)
        if owner is not None:
            if owner.last_model_path:
                return Path(owner.last_model_path)
            return Path(owner.format_checkpoint_name(owner._monitor_candidates(trainer), owner.CHECKPOINT_NAME_LAST))
        return self._folder(trainer) / (self.filename or "last.ckpt")

    def _save(self, trainer: pl.Trainer, at_epoch_end: bool = False) -> Path:
        owner = self._owner(trainer)
        if owner is None:
            path = self.path
            trainer.save_checkpoint(path, weights_only=False)
        elif owner.last_model_path and getattr(owner, "_last_global_step_saved", None) == trainer.global_step:
            path = Path(owner.last_model_path)  # it wrote `last` at this step already
        else:
            candidates = owner._monitor_candidates(trainer)
            if owner.save_last == "link":
                # Its `last` links to its latest top-k file, which may be older than this step: write the
                # file itself (after removing the link, which a save would write through).
                linked = owner.format_checkpoint_name(candidates, owner.CHECKPOINT_NAME_LAST)
                if trainer.is_global_zero and os.path.islink(linked):
                    os.remove(linked)
                trainer.strategy.barrier("StopAndSave")
                owner._last_checkpoint_saved = ""
            saved_step = getattr(owner, "_last_global_step_saved", None)
            owner._save_last_checkpoint(trainer, candidates)  # its name, version counter and last_model_path
            if at_epoch_end:
                # Lightning calls the ModelCheckpoints' on_train_epoch_end after every other callback's: left
                # marked as saved at this step, it would skip its own epoch-end save (a top-k file, then `last`
                # again, the same step).
                owner._last_global_step_saved = saved_step
            path = Path(owner.last_model_path)
        self.last_saved, self.last_step = path, trainer.global_step
        return path

    def _saved_this_step(self, trainer: pl.Trainer) -> bool:
        if self.last_step == trainer.global_step and self.last_saved is not None:
            return True
        owner = self._owner(trainer)
        if (
            owner is not None
            and owner.last_model_path
            and getattr(owner, "_last_global_step_saved", None) == trainer.global_step
        ):
            self.last_saved, self.last_step = Path(owner.last_model_path), trainer.global_step
            return True
        return False

    # ------------------------------------------------------------------ how to go on
    def resume_hint(self, python: Optional[bool] = None) -> Optional[str]:
        """How to continue from the last checkpoint of this fit: ``trainer.fit(model, ckpt_path="...")``
        from Python, ``commsched-train resume=<run dir> (and the same options)`` on the command line
        (default: as this callback was made); None when no checkpoint was saved."""
        last = self.last_saved
        if last is None:
            owner = self._owner(self._trainer)
            last = Path(owner.last_model_path) if owner is not None and owner.last_model_path else None
        if last is None:
            return None
        if python if python is not None else not self.command_line:
            return f"trainer.fit(model, ckpt_path={str(last)!r})"
        run = last.parent.parent if last.name == "last.ckpt" and last.parent.name == "checkpoints" else last
        return f"commsched-train resume={run} (and the same options)"

    @rank_zero_only
    def _say(self, line: str) -> None:
        print(f"commsched: {line}", flush=True)

    def _closing_line(self, trainer: pl.Trainer) -> None:
        """At a fit's end, unless the strategy's closing summary says it: a commsched strategy's does (it
        reads `resume_hint`) and says so with `says_resume_hint`; this module does not import the strategy,
        which imports it."""
        hint = self.resume_hint()
        if hint is not None and not getattr(trainer.strategy, "says_resume_hint", False):
            self._say(f"last checkpoint {self.last_saved} (step {self.last_step}); continue with: {hint}")

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if signum == signal.SIGTERM and now - self._last_sigterm < SAME_SIGTERM_S:
            return  # one stop delivered twice: to the process group (a cluster's launcher, scancel) and forwarded
        if signum == signal.SIGTERM:
            self._last_sigterm = now
        self.signals_seen += 1
        if self.signals_seen > 1:
            if self.command_line:
                end_if_shutdown_hangs(self._last_checkpoint_said)
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        self._announce(signal.Signals(signum).name)

    def _last_checkpoint_said(self) -> str:
        last = self.last_saved
        return f"the last checkpoint is {last}" if last is not None else "no checkpoint was saved in this fit"

    def _where_it_saves(self) -> str:
        """Where the stop will save, from attributes alone. A signal handler runs between any two
        bytecodes of the main thread, also in the middle of Lightning's metric synchronisation: reading
        `trainer.callback_metrics` there (as a `ModelCheckpoint`'s file name template needs) would start
        collectives of its own on this rank only, and every rank would wait for the others for ever."""
        trainer = self._trainer
        owner = self._owner(trainer)
        if owner is None:
            return str(self._folder(trainer) / (self.filename or "last.ckpt"))
        if "{" in owner.CHECKPOINT_NAME_LAST:  # named from the metrics at the save, not the last save's name
            return f"the last checkpoint in {owner.dirpath}"
        if owner.last_model_path:
            return str(owner.last_model_path)
        return str(Path(owner.dirpath) / f"{owner.CHECKPOINT_NAME_LAST}{owner.FILE_EXTENSION}")

    @rank_zero_only
    def _announce(self, name: str) -> None:
        line = (
            f"commsched: {name} received: stopping at the next step every rank reaches and saving "
            f"{self._where_it_saves()} (press Ctrl-C again to stop at once, without saving)\n"
        )
        if type(sys.stdout) is io.TextIOWrapper:
            # A plain file's buffered writer raises "reentrant call" if the signal landed inside a print of
            # the main thread: write to its descriptor. Other streams (a rich progress bar's proxy, which
            # keeps its display above the line; a notebook's; a test's capture) take a print.
            os.write(sys.stdout.fileno(), line.encode())
        else:
            print(line, end="", flush=True)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    # ------------------------------------------------------------------ callback
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self.last_saved = self.last_step = None

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A ModelCheckpoint whose folder is not the one its state was saved in keeps only best_model_path, and
        # warns on every rank; a resumed run in a new folder is the usual case, so: the same, without the warning.
        states = checkpoint.get("callbacks") or {}
        for callback in trainer.checkpoint_callbacks:
            state = states.get(callback.state_key) if isinstance(callback, ModelCheckpoint) else None
            if state and "dirpath" in state and state["dirpath"] != callback.dirpath:
                states[callback.state_key] = {
                    "dirpath": callback.dirpath,
                    "best_model_score": callback.best_model_score,
                    "best_model_path": state.get("best_model_path", ""),
                }

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning registered its own SIGTERM handler (which stops each rank wherever it is).
        if trainer.state.fn == "fit":
            self._install()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._step_at_batch_start:
            return  # mid-accumulation (or a batch that took no step): a checkpoint here would lose gradients
        if self._stop_at is None:
            self._stop_at = self._agreed_stop(step)
        if self._stop_at is not None and step >= self._stop_at:
            path = self.last_saved if self._saved_this_step(trainer) else self._save(trainer)
            assert path is not None
            self.stopped_at, self.saved = step, path
            if not self.command_line:  # commsched-train says it in its own line
                self._say(f"stopped at step {step} and saved {path}; continue with: {self.resume_hint()}")
            raise StoppedBySignal(step, path)

    def _agreed_stop(self, step: int) -> Optional[int]:
        """Posts a stop step if this rank saw a signal; returns the stop step once any rank posted one."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return step if self.signals_seen else None
        store = dist.distributed_c10d._get_default_store()
        if self.signals_seen and not self._posted:
            self._posted = True
            return int(store.compare_set(STOP_KEY, "", str(step + AHEAD)))
        if store.check([STOP_KEY]):
            return int(store.get(STOP_KEY))
        return None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (
            self.every_epoch
            and self.stopped_at is None
            and not trainer.sanity_checking
            and not self._saved_this_step(trainer)
        ):
            self._save(trainer, at_epoch_end=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The fit's final step (a run bounded by steps ends in the middle of an epoch, or every_epoch is off).
        if trainer.global_step > 0 and not self._saved_this_step(trainer):
            self._save(trainer)
        self._closing_line(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        self._restore()
        if self._posted or self._stop_at is not None:  # every rank read the key before the save they joined
            if trainer.is_global_zero and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.distributed_c10d._get_default_store().delete_key(
                    STOP_KEY
                )  # a later fit in these processes starts clean
            self._posted, self._stop_at = False, None
