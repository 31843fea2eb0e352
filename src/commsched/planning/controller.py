"""Changing the fusion plan during training, the same way on every rank.

Model policies (`mgwfbp`, `mgwfbp-greedy`, `dear-model`) start on fixed buckets, let the profiler
measure the first steps and probe the link, then rank 0 plans from its profile and broadcasts the
plan; `bayes` runs trials of bucket sizes, rank 0 measuring each and choosing the next. Every change
happens in the strategy's batch-start hook, an iteration boundary that every rank reaches at the
same batch, where the strategy flushes the schedule and rebuilds its buckets.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_info

from commsched.buckets import param_infos, trainable_in_ready_order
from commsched.fusion import MODEL_POLICIES, ParamInfo, plan_fixed
from commsched.links import Link
from commsched.planning.bayes import BayesOptions, BucketSizeTuner
from commsched.planning.model_plans import plan_from_profile
from commsched.planning.plan_file import SavedPlan

Planner = Callable[[Sequence[ParamInfo]], list[list[int]]]


def share_plan(plan: Optional[SavedPlan], module: torch.nn.Module, link: Link) -> SavedPlan:
    """Rank 0's plan on every rank: each parameter's bucket index (ready order) and the plan's numbers."""
    names = trainable_in_ready_order(module)[0]
    codes = torch.full((len(names),), -1, dtype=torch.int64)
    numbers = torch.full((3,), float("nan"), dtype=torch.float64)
    if link.rank == 0:
        assert plan is not None
        bucket_of = {n: b for b, bucket in enumerate(plan.buckets) for n in bucket}
        codes = torch.tensor([bucket_of.get(n, -1) for n in names], dtype=torch.int64)
        numbers = torch.tensor([plan.predicted_s or float("nan"), plan.lower_bound_s or float("nan"),
                                plan.world_size], dtype=torch.float64)
    link.broadcast(codes, 0, "plan-decision").wait()
    link.broadcast(numbers, 0, "plan-decision").wait()
    buckets: dict[int, list[str]] = {}
    for name, code in zip(names, codes.tolist()):
        if code >= 0:
            buckets.setdefault(code, []).append(name)
    predicted, bound, world = numbers.tolist()
    details = plan.details if plan is not None else {}
    policy = plan.policy if plan is not None else ""
    shared = SavedPlan(policy, int(world), [buckets[k] for k in sorted(buckets)],
                       None if predicted != predicted else predicted, None if bound != bound else bound, details)
    return shared


class PlanController:
    def __init__(self, policy: str, bucket_cap_mb: float, bayes: BayesOptions, seed: int = 0) -> None:
        self.policy = policy
        self.bayes = bayes
        self.decided: Optional[SavedPlan] = None  # the final plan, once there is one
        self.trials: list[dict[str, float]] = []
        self._cap_mb = bayes.first_mb if policy == "bayes" else bucket_cap_mb
        self._tuner = BucketSizeTuner(bayes, seed=seed) if policy == "bayes" else None
        self._batches_in_trial = 0
        self._last_start: Optional[float] = None
        self._durations: list[float] = []
        self._final_pending = False

    @property
    def tuning(self) -> bool:
        return self.decided is None

    def adopt(self, plan: SavedPlan) -> None:
        """A plan from a file or a checkpoint: nothing left to decide."""
        self.decided = plan

    def planner(self) -> Planner:
        if self.decided is not None:
            return self.decided.planner()
        return partial(plan_fixed, cap_bytes=int(self._cap_mb * 2**20))

    def on_batch_start(self, strategy: Any) -> Optional[Planner]:
        """A new planner when the plan changes at this boundary, else None."""
        if self.decided is not None:
            return None
        if self.policy in MODEL_POLICIES:
            return self._plan_from_model(strategy)
        return self._bayes_step(strategy)

    def _plan_from_model(self, strategy: Any) -> Optional[Planner]:
        profile = strategy.profile
        if profile is None:
            return None  # still profiling
        module, link = strategy.lightning_module, strategy.control_link
        mine = plan_from_profile(profile, self.policy) if link.rank == 0 else None
        self.decided = share_plan(mine, module, link)
        self._announce(strategy)
        return self.decided.planner()

    def _bayes_step(self, strategy: Any) -> Optional[Planner]:
        now = time.perf_counter()
        if self._last_start is not None and self._batches_in_trial > self.bayes.warmup_steps:
            self._durations.append(now - self._last_start)
        self._last_start = now
        self._batches_in_trial += 1
        if len(self._durations) < self.bayes.trial_steps:
            return None
        link: Link = strategy.control_link
        decision = torch.zeros(3, dtype=torch.float64)  # measured step, next size, final?
        if link.rank == 0:
            assert self._tuner is not None
            self._tuner.layout_of = partial(_fixed_layout, strategy.lightning_module)
            step = statistics.median(self._durations)
            self._tuner.record(self._cap_mb, step)
            proposed = None if self._tuner.done else self._tuner.next_size()
            final = proposed is None
            if final and len(self._tuner.trials) < self.bayes.trials:
                rank_zero_info(f"commsched bayes: every size proposed gives buckets already measured; "
                               f"stopping after {len(self._tuner.trials)} of {self.bayes.trials} trials")
            chosen = self._tuner.best().bucket_mb if final else proposed
            decision = torch.tensor([step, chosen, float(final)], dtype=torch.float64)
        link.broadcast(decision, 0, "bayes-decision").wait()
        step, chosen, final = decision.tolist()
        self.trials.append({"trial": len(self.trials), "bucket_mb": self._cap_mb, "step_ms": step * 1e3})
        _log(strategy, {"bayes/trial": len(self.trials) - 1, "bayes/bucket_mb": self._cap_mb, "bayes/step_ms": step * 1e3})
        rank_zero_info(f"commsched bayes: trial {len(self.trials) - 1}: {self._cap_mb:.2f} MB buckets, "
                       f"median step {step * 1e3:.1f} ms")
        self._cap_mb = chosen
        self._durations, self._batches_in_trial, self._last_start = [], 0, None
        self._final_pending = bool(final)
        return partial(plan_fixed, cap_bytes=int(chosen * 2**20))

    def rebuilt(self, strategy: Any) -> None:
        """After the strategy rebuilt its buckets: a final Bayesian choice becomes the decided plan."""
        if not self._final_pending:
            return
        self._final_pending = False
        names = [list(b.names) for b in strategy.bucket_plan.buckets]
        self.decided = SavedPlan("bayes", strategy.world_size, names,
                                 details={"bucket_mb": self._cap_mb, "trials": self.trials})
        self._announce(strategy)

    def _announce(self, strategy: Any) -> None:
        assert self.decided is not None
        plan = self.decided
        if strategy.global_rank == 0:
            path = Path(strategy.lightning_module.trainer.default_root_dir) / "commsched_plan.json"
            plan.save(path)
            predicted = f", predicted {plan.predicted_s * 1e3:.1f} ms/step" if plan.predicted_s else ""
            rank_zero_info(f"commsched: fusion '{plan.policy}' chose {len(plan.buckets)} buckets{predicted}; "
                           f"saved to {path}")


def _fixed_layout(module: torch.nn.Module, bucket_mb: float) -> tuple[tuple[int, ...], ...]:
    """The buckets `bucket_mb` gives this model: sizes with equal layouts are the same trial."""
    return tuple(map(tuple, plan_fixed(param_infos(module), cap_bytes=int(bucket_mb * 2**20))))


def _log(strategy: Any, metrics: dict[str, float]) -> None:
    trainer = strategy.lightning_module.trainer
    if trainer.logger is not None and strategy.global_rank == 0:
        trainer.logger.log_metrics(metrics, step=trainer.global_step)
