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

import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger(__name__)

STOP_KEY = "commsched/stop_at_step"
AHEAD = 2
SAME_SIGTERM_S = 1.0
"""A SIGTERM this soon after another is the same stop arriving twice (the process group's and the
launcher's forwarded copy), not a second request to stop at once."""
"""Steps between the signal being seen and the agreed stop: ranks are at most one step apart."""


class StoppedBySignal(SystemExit):
    """Raised on every rank at the agreed step, after the checkpoint is written: exit code 130, as a shell gives Ctrl-C."""

    def __init__(self, step: int, saved: Path) -> None:
        super().__init__(130)
        self.step, self.saved = step, saved

    def __str__(self) -> str:
        return f"stopped at step {self.step}; saved {self.saved}"


class StopAndSave(pl.Callback):
    """Saves `dirpath/filename` at the end of every training epoch and when the run is interrupted.

    Args:
        dirpath: where the checkpoint goes; default: the Trainer's `ModelCheckpoint` directory, else
            `<default_root_dir>/checkpoints`.
        filename: the checkpoint's file name; `last.ckpt` is what `commsched-train resume=<run dir>` reads.
        every_epoch: also save at each epoch end: Lightning's `ModelCheckpoint(save_last=True)` writes
            `last` only beside a checkpoint of its own, so with no monitor, or a step cadence, a run
            could end an epoch with nothing to resume from.
    """

    def __init__(self, dirpath: Optional[Union[str, Path]] = None, filename: str = "last.ckpt", every_epoch: bool = True) -> None:
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename
        self.every_epoch = every_epoch
        self.signals_seen = 0
        self._last_sigterm = -math.inf
        self.stopped_at: Optional[int] = None
        """The step the run stopped at on a signal (None: it was not interrupted)."""
        self.saved: Optional[Path] = None
        """The checkpoint written at the stop."""
        self._stop_at: Optional[int] = None
        self._posted = False
        self._step_at_batch_start = 0
        self._previous: dict[int, Any] = {}

    @property
    def path(self) -> Path:
        assert self.dirpath is not None, "set in setup()"
        return self.dirpath / self.filename

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if signum == signal.SIGTERM and now - self._last_sigterm < SAME_SIGTERM_S:
            return  # one stop delivered twice: to the process group (a cluster's launcher, scancel) and forwarded
        if signum == signal.SIGTERM:
            self._last_sigterm = now
        self.signals_seen += 1
        if self.signals_seen > 1:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        self._announce(signal.Signals(signum).name)

    @rank_zero_only
    def _announce(self, name: str) -> None:
        print(f"commsched: {name} received: stopping at the next step every rank reaches and saving {self.path} "
              "(press Ctrl-C again to stop at once, without saving)", flush=True)

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
        if self.dirpath is None:
            chosen = trainer.checkpoint_callback
            found = getattr(chosen, "dirpath", None)
            self.dirpath = Path(found) if found else Path(trainer.default_root_dir) / "checkpoints"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning registered its own SIGTERM handler (which stops each rank wherever it is).
        if trainer.state.fn == "fit":
            self._install()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._step_at_batch_start:
            return  # mid-accumulation (or a batch that took no step): a checkpoint here would lose gradients
        if self._stop_at is None:
            self._stop_at = self._agreed_stop(step)
        if self._stop_at is not None and step >= self._stop_at:
            trainer.save_checkpoint(self.path, weights_only=False)
            self.stopped_at, self.saved = step, self.path
            raise StoppedBySignal(step, self.path)

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
        if self.every_epoch and self.stopped_at is None and not trainer.sanity_checking:
            trainer.save_checkpoint(self.path, weights_only=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        self._restore()
        if self._posted or self._stop_at is not None:  # every rank read the key before the save they joined
            if trainer.is_global_zero and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.distributed_c10d._get_default_store().delete_key(STOP_KEY)  # a later fit in these processes starts clean
            self._posted, self._stop_at = False, None
