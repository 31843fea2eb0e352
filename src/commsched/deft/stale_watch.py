"""The watch on a stale plan: its first iterations' training loss against that of the iterations
before it, and the way back when the loss did not fall.

Nothing measured before a stale plan runs tells a harmful one from a harmless one (docs/deft.md:
neither the walk, nor a curvature snapshot, nor a short trial); the loss once it runs does. After
`window` iterations of the plan, the mean training loss over them is compared with the mean over the
`window` iterations before it started, averaged over every rank so that every rank decides the same.
If it did not fall, the plan is stopped. With `rollback`, the weights, buffers and optimizer state go
back to where the plan started and its generations in flight are dropped: the run is then synchronous
training that skipped `window` batches. Without, what is in flight is applied and training goes on
from there.

The snapshot is one copy of the model's state and of the optimizer's per-parameter state, held in host
memory from the plan's first iteration until the verdict, and saved with the communication state so
that a run resumed inside the window decides as the uninterrupted one (the weights and the optimizer
state once, as every rank holds the same; the buffers per rank, as BatchNorm's running statistics
differ between ranks unless they are broadcast). The optimizer's hyperparameters (its learning rate,
as the LR scheduler has moved it) are not rolled back.

Losses are read only where a stale plan may run (`max_staleness` > 0): until the verdict, that costs
one wait on the device per iteration, at the iteration's start.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from commsched.comm.links import Link
from commsched.say import say
from commsched.state import to_cpu


class StaleWatch:
    def __init__(self, window: int, rollback: bool) -> None:
        """`window` 0: nothing is watched (and no loss read)."""
        self.window, self.rollback = window, rollback
        self.losses: deque[float] = deque(maxlen=max(1, window))
        """This rank's mean training loss of each recent iteration (oldest first), since measuring began."""
        self.before: Optional[float] = None
        """This rank's mean loss over the iterations before the plan started; None: not watching."""
        self.watched = 0
        """Iterations of the plan since it started."""
        self.snapshot: Optional[dict[str, Any]] = None
        self.verdict: Optional[str] = None
        """What the watch decided on the plan now solved ("kept" or "stopped", with the two losses); None
        before it decided."""
        self.verdicts: list[str] = []
        """Every verdict of this run, in order."""
        self.stale_refused = False
        """A verdict stopped a plan in this run: only exact plans from then on."""
        self._pending: list[torch.Tensor] = []
        """This iteration's losses as `training_step` returned them (read without waiting on the device)."""

    @property
    def enabled(self) -> bool:
        return self.window > 0

    @property
    def watching(self) -> bool:
        return self.before is not None

    @property
    def due(self) -> bool:
        return self.watching and self.watched >= self.window

    def wants_losses(self, settled: bool, stale_plan_runs: bool) -> bool:
        """Losses are read until the verdict on the plan now solved; never once stale plans are refused,
        nor when the plan settled on is not stale."""
        if not self.enabled or self.stale_refused or self.verdict is not None:
            return False
        return not settled or stale_plan_runs

    def listen(self, loss: torch.Tensor, settled: bool, stale_plan_runs: bool) -> None:
        """A micro-batch's loss, as `training_step` returned it."""
        if self.wants_losses(settled, stale_plan_runs):
            self._pending.append(loss.detach())

    def iteration_ended(self, control: Link) -> bool:
        """At the next iteration's start: record the last one's loss and, once the window is over,
        judge; True when the plan must stop."""
        if not self.enabled:
            return False
        pending, self._pending = self._pending, []
        if self.watching:
            self.watched += 1  # whatever the loss: every rank judges at the same iteration
        if pending:
            self.losses.append(float(torch.stack([x.float().mean() for x in pending]).mean()))
        if not self.due:
            return False
        stopped = self.judge(control)
        if not stopped:
            say(f"commsched Preserver: the stale plan is kept ({self.verdict})")
        return stopped

    def restart(self) -> None:
        """Measuring starts again (a re-plan, new buckets, a stop): the next plan is judged against the
        iterations measured from now on, from a snapshot of its own."""
        self.before, self.watched, self.snapshot, self.verdict = None, 0, None, None
        self.losses.clear()
        self._pending = []

    def starts_now(self, stale_plan_runs: bool) -> bool:
        """A stale plan runs from this iteration on, and was not watched or judged yet."""
        return self.enabled and stale_plan_runs and not self.watching and self.verdict is None

    def start(self, module: nn.Module, optimizer: Optional[Optimizer], updates: int) -> None:
        """Remember the loss so far (and, with `rollback`, the state) of the plan starting now."""
        self.before = sum(self.losses) / len(self.losses) if self.losses else -math.inf  # nothing to compare with: stop
        self.losses.clear()
        self.watched = 0
        if self.rollback:
            state = module.state_dict()
            buffers = {name for name, _ in module.named_buffers()}
            self.snapshot = {
                "module": to_cpu({k: v for k, v in state.items() if k not in buffers}),
                "buffers": to_cpu({k: v for k, v in state.items() if k in buffers}),
                "updates": updates,
                "optimizer": to_cpu(optimizer.state_dict()["state"]) if optimizer is not None else None,
            }

    def judge(self, control: Link) -> bool:
        """True when the plan must stop: the mean loss over every rank did not fall (NaN counts as not
        falling). A collective on the control link: every rank calls it at the same iteration."""
        assert self.before is not None
        after = sum(self.losses) / len(self.losses) if self.losses else math.inf
        means = control.tensor([self.before, after], torch.float64)
        control.all_reduce(means, "deft-watch").wait()
        before, after = (value / control.world_size for value in means.tolist())
        stopped = not after < before
        self.stale_refused = self.stale_refused or stopped
        compared = (
            f"mean loss {before:.4g} before, {after:.4g} over its first {self.window} iterations"
            if before > -math.inf
            else "no loss of the iterations before it to compare with"
        )
        self.verdict = f"{'stopped' if stopped else 'kept'}: {compared}"
        self.verdicts.append(self.verdict)
        self.before, self.watched = None, 0
        if not stopped:
            self.snapshot = None
        return stopped

    @torch.no_grad()
    def roll_back(self, module: nn.Module, optimizer: Optional[Optimizer]) -> Optional[int]:
        """The state of the plan's first iteration, copied in place (parameters stay the objects the
        buckets and the optimizer hold); returns the optimizer steps taken then, None without a snapshot."""
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is None:
            return None
        module.load_state_dict({**snapshot["module"], **snapshot["buffers"]})
        if optimizer is not None and snapshot["optimizer"] is not None:
            state = optimizer.state_dict()
            state["state"] = snapshot["optimizer"]
            optimizer.load_state_dict(state)
        return int(snapshot["updates"])

    def describe(self) -> str:
        """For the run's summary line: the verdict on the plan now solved, and whether stale plans are refused."""
        watched = f"; the watch {self.verdict}" if self.verdict is not None else ""
        return watched + ("; stale plans refused after the watch stopped one" if self.stale_refused else "")

    def shared_state(self, restarting: bool = False) -> dict[str, Any]:
        """What every rank holds alike: the verdicts and refusal of the run, and (unless measuring starts
        again) the plan's progress and the snapshot of its weights and optimizer state (saved once)."""
        run = {"verdicts": list(self.verdicts), "stale_refused": self.stale_refused}
        if restarting:
            return run
        shared = None if self.snapshot is None else {k: v for k, v in self.snapshot.items() if k != "buffers"}
        return {**run, "watched": self.watched, "verdict": self.verdict, "snapshot": shared}

    def rank_state(self, restarting: bool = False) -> dict[str, Any]:
        """This rank's own losses (those of the iteration not yet recorded too) and buffers."""
        if restarting:
            return {}  # the iterations measured from the restart on are compared, not the one before it
        return {
            "losses": list(self.losses),
            "before": self.before,
            "pending": [float(x.float().mean()) for x in self._pending],
            "buffers": None if self.snapshot is None else self.snapshot["buffers"],
        }

    def load_run(self, saved: dict[str, Any]) -> None:
        """What holds for the whole run, whatever the buckets: the verdicts and the refusal."""
        self.verdicts = list(saved.get("verdicts", []))
        self.stale_refused = bool(saved.get("stale_refused", False))

    def load(self, saved: dict[str, Any]) -> None:
        """From the merged shared and per-rank states (absent keys: saved while restarting, or before the
        watch existed)."""
        self.load_run(saved)
        self.losses.clear()
        self.losses.extend(saved.get("losses", []))
        self.before, self.watched, self.verdict = saved.get("before"), saved.get("watched", 0), saved.get("verdict")
        shared = saved.get("snapshot")
        self.snapshot = None if shared is None else {**shared, "buffers": saved.get("buffers") or {}}
        self._pending = [torch.tensor(x) for x in saved.get("pending", [])]
