"""The Preserver ([DeFT] §IV-C): a plan is used only if the Gaussian walk says it converges as
synchronous training would; otherwise the knapsacks are enlarged and the plan solved again.

Add it to the Trainer's callbacks: ``Trainer(strategy="deft", callbacks=[commsched.Preserver()])``.
It watches the training loss, the learning rate and the batch size; DeFT hands it the gradient
statistics measured on its synchronous probe steps (`commsched.deft.walk.gradient_statistics`) and
asks it to choose among plans of growing capacity.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch

from commsched.deft.curvature import CurvatureUnavailable, top_curvature
from commsched.deft.plan import DeFTPlan
from commsched.deft.stability import largest_stable_curvature
from commsched.deft.walk import WalkState, plan_ratio
from commsched.options import check_preserver_settings as check_settings
from commsched.options import flag, non_negative_int, non_negative_number, positive_int
from commsched.say import say

log = logging.getLogger(__name__)


class Preserver(pl.Callback):
    def __init__(
        self,
        eps: float = 0.01,
        max_tries: int = 10,
        growth: float = 1.25,
        optimum: float = 0.0,
        batch_size: Optional[int] = None,
        recheck_every_n_steps: int = 0,
        max_staleness: int = 0,
        curvature_margin: float = 0.0,
        watch_steps: int = 10,
        rollback: bool = True,
        stale_after_steps: Optional[int] = None,
    ) -> None:
        """
        Args:
            eps: accept a plan when E(loss) after it over E(loss) after synchronous steps is within [1-eps, 1+eps].
            max_tries: plans solved at most (capacity x growth each time); after them, no delay.
            growth: how much each retry enlarges the knapsacks' capacity (> 1).
            optimum: S*, the lowest loss the walk can reach.
            batch_size: samples per rank and step (default: the first dimension of the batch's first tensor).
            recheck_every_n_steps: > 0: every N steps, ask DeFT to measure and solve again (the gradient
                statistics change as training goes on); 0: decide once.
            max_staleness: plans whose generations step more than this many iterations after their last
                gradient are rejected whatever the walk says. The walk models batch sizes, not stale
                gradients. 0: none. Within it, a stale plan is accepted where it was measured to keep
                accuracy: one iteration late under SGD with momentum >= 0.9, compensated as DeFT's
                "auto" does (not on every model: see docs/deft.md).
            curvature_margin: > 0: a stale plan is also accepted where the optimizer, compensated as it
                runs and with that staleness, stays stable (`deft.stability`) on the loss's top
                curvature, measured on DeFT's probe steps, times this margin; 0: no curvature measured.
            watch_steps: a stale plan that runs is watched for this many iterations: if their mean training
                loss (over every rank) is not below that of as many iterations before it, the plan is
                stopped and stale plans are refused for the rest of the run (DeFT measures and solves
                again). 0: not watched. It judges once: a plan that harms later is not caught (VGG-16-BN
                at lr 0.05 in 13 of 77 seeds, docs/deft.md).
            rollback: when the watch stopped a plan, the weights, buffers and optimizer state go back to
                where it started (its iterations are dropped); False: training goes on from where they left it.
            stale_after_steps: no stale plan runs before this many steps of training (DeFT decides an exact
                plan until then, and solves again at that step); None: one epoch (200 steps where the
                training loader has no length). The first steps are where staleness harms most and where
                the watch cannot tell (docs/deft.md).
        """
        self.eps, self.max_tries, self.growth = check_settings(eps, max_tries, growth)
        self.optimum = float(optimum)
        self._last_recheck = -1
        self.local_batch: Optional[int] = (
            positive_int("Preserver.batch_size", batch_size) if batch_size is not None else None
        )
        self.last_loss: Optional[float] = None
        self.last_lr = 0.0
        self.decisions: list[dict[str, Any]] = []
        self.recheck_every_n_steps = non_negative_int("Preserver.recheck_every_n_steps", recheck_every_n_steps)
        self.max_staleness = non_negative_int("Preserver.max_staleness", max_staleness)
        self.curvature_margin = non_negative_number("Preserver.curvature_margin", curvature_margin)
        self.watch_steps = non_negative_int("Preserver.watch_steps", watch_steps)
        self.rollback = flag("Preserver.rollback", rollback)
        self.stale_after_steps = (
            None if stale_after_steps is None else non_negative_int("Preserver.stale_after_steps", stale_after_steps)
        )
        self.curvature_wanted = False
        """Set by DeFT for a probe step: measure the top curvature from this step's loss."""
        self.walk: Optional[WalkState] = None
        """What the walk started from at the last decision: loss, eta, mu, sigma, batch, as measured."""
        self.curvatures: list[Optional[float]] = []
        """This rank's measurements since the last decision (None: the loss has no second derivative)."""

    @property
    def needs_curvature(self) -> bool:
        """Only a stale plan is judged by curvature, and only when asked (`curvature_margin` > 0)."""
        return self.max_staleness > 0 and self.curvature_margin > 0

    CURVATURE_PROBES = 2
    """Probe steps whose loss also gives the top curvature (left out of DeFT's stage times)."""

    def ask_for_curvature(self, probe: int, measure_steps: int) -> bool:
        """DeFT's measured step number `probe` of `measure_steps`: the first ones, all but the last, also
        measure the curvature when a stale plan may be judged; True when this one does."""
        self.curvature_wanted = self.needs_curvature and probe < min(self.CURVATURE_PROBES, measure_steps - 1)
        return self.curvature_wanted

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if not self.curvature_wanted:
            return
        self.curvature_wanted = False  # one micro-batch per probe step
        params = [p for p in pl_module.parameters() if p.requires_grad]
        try:
            # Lightning hands the loss divided by the accumulation: the step's curvature is the sum's.
            self.curvatures.append(top_curvature(loss, params) * max(1, trainer.accumulate_grad_batches))
        except CurvatureUnavailable as error:
            say(
                f"commsched Preserver: no curvature from this loss ({str(error).splitlines()[0]}); "
                "stale plans are rejected"
            )
            self.curvatures.append(None)

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        n = self.recheck_every_n_steps
        if n and trainer.global_step and trainer.global_step % n == 0 and hasattr(trainer.strategy, "request_replan"):
            if self._last_recheck != trainer.global_step:  # once per step (accumulation calls this per micro-batch)
                self._last_recheck = trainer.global_step
                say(f"commsched Preserver: re-checking DeFT's plan at step {trainer.global_step}")
                trainer.strategy.request_replan()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.last_loss = float(loss.detach())
        if trainer.optimizers:
            self.last_lr = float(trainer.optimizers[0].param_groups[0]["lr"])
        if self.local_batch is None:
            self.local_batch = _batch_size(batch)

    def choose(
        self, solve: Callable[[Optional[float]], DeFTPlan], capacity: Optional[float], stats: dict[str, float]
    ) -> tuple[DeFTPlan, list[dict[str, Any]]]:
        """The first plan whose ratio is within [1-eps, 1+eps], enlarging the capacity up to `max_tries`
        times, else the plan without delay. Every decision is logged and returned."""
        state = WalkState(
            loss=stats["loss"],
            lr=stats["lr"],
            mu=stats["mu"],
            sigma=stats["sigma"],
            batch=max(1, int(stats["batch"])),
            optimum=self.optimum,
        )
        self.walk = state
        decisions = []
        for attempt in range(self.max_tries):
            plan = solve(capacity)
            ratio = float(plan_ratio(state, plan.k))
            stable_below = self._stable_below(stats, plan.staleness)
            accepted = bool(abs(ratio - 1) <= self.eps) and self._keeps_accuracy(plan.staleness, stats, stable_below)
            decisions.append(self._say(attempt, plan, capacity, ratio, accepted, stats, stable_below))
            if accepted or capacity is None:
                return plan, decisions
            capacity *= self.growth
        plan = solve(None)
        decisions.append(self._say(self.max_tries, plan, None, 1.0, True))
        return plan, decisions

    def _keeps_accuracy(self, staleness: int, stats: dict[str, Any], stable_below: Optional[float]) -> bool:
        """Synchronous plans always; a stale one within `max_staleness` where it was measured to keep
        accuracy with this compensation and optimizer, or where the measured curvature is inside the
        compensated optimizer's stable band."""
        if staleness == 0:
            return True
        if staleness > self.max_staleness or stats.get("stale_barred"):
            return False
        if staleness <= int(stats.get("measured_staleness", 0)):
            return True
        return stable_below is not None and self._curvature(stats) * self.curvature_margin < stable_below

    def _curvature(self, stats: dict[str, Any]) -> float:
        """The agreed top curvature; infinite when it could not be measured (nothing shows a stale plan stable)."""
        value = stats.get("curvature")
        return math.inf if value is None else float(value)

    def _stable_below(self, stats: dict[str, Any], staleness: int) -> Optional[float]:
        """The curvature above which the optimizer diverges with this staleness (None: not judged)."""
        if staleness == 0 or not self.needs_curvature or staleness > self.max_staleness:
            return None
        stepper = stats.get("stepper")
        return (
            largest_stable_curvature(stepper, staleness, stats.get("compensation", "none"))
            if stepper is not None
            else 0.0
        )

    def _say(
        self,
        attempt: int,
        plan: DeFTPlan,
        capacity: Optional[float],
        ratio: float,
        accepted: bool,
        stats: Optional[dict[str, Any]] = None,
        stable_below: Optional[float] = None,
    ) -> dict[str, Any]:
        decision = {
            "attempt": attempt,
            "capacity": capacity,
            "k": list(plan.k),
            "n": plan.n,
            "ratio": ratio,
            "staleness": plan.staleness,
            "accepted": accepted,
            "walk": asdict(self.walk) if self.walk else None,
        }
        judged = ""
        if plan.staleness and stats is not None:
            compensation = stats.get("compensation", "none")
            decision.update(compensation=compensation, measured_staleness=int(stats.get("measured_staleness", 0)))
            if plan.staleness > self.max_staleness:
                judged = f", staleness above max_staleness={self.max_staleness}"
            elif stats.get("stale_barred"):
                judged = f", stale plans {stats['stale_barred']}"
                # waiting: accepted once the wait is over, if nothing else changes (DeFT solves again then)
                waits = (
                    stats.get("stale_wait_until") is not None
                    and plan.staleness <= self.max_staleness
                    and self._keeps_accuracy(plan.staleness, {**stats, "stale_barred": None}, stable_below)
                )
                decision.update(barred=stats["stale_barred"], waiting=waits, wait_until=stats.get("stale_wait_until"))
            elif plan.staleness <= decision["measured_staleness"]:
                judged = (
                    f", compensated by {compensation} (measured to keep accuracy "
                    f"{decision['measured_staleness']} iteration late)"
                )
            else:
                judged = (
                    f", compensation {compensation}: not measured to keep accuracy {plan.staleness} iteration(s) late"
                )
        if stable_below is not None and stats is not None:
            curvature = self._curvature(stats)
            decision.update(curvature=curvature, stable_below=stable_below, margin=self.curvature_margin)
            judged += (
                f"; top curvature {curvature:.3g} x margin {self.curvature_margin:g} against {stable_below:.3g} "
                f"(where the optimizer with staleness {plan.staleness} stops converging)"
            )
        self.decisions.append(decision)
        cap = "unlimited (no delay)" if capacity is None or math.isinf(capacity) else f"{capacity:.3g}x"
        say(
            f"commsched Preserver: capacity {cap}, N={plan.n}, K={list(plan.k)}, staleness {plan.staleness}: "
            f"ratio {ratio:.4f}{judged} -> {'accepted' if accepted else 'rejected'}"
        )
        return decision


def _batch_size(batch: Any) -> Optional[int]:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for part in batch:
            size = _batch_size(part)
            if size:
                return size
    return None
