"""The fusion plan during training: which planner builds the buckets, and when that changes.

The policy decides only at iteration boundaries (the strategy's batch-start hook, reached by every
rank at the same batch); rank 0 decides and `Link.broadcast_object` hands the decision to every
rank, so all ranks rebuild together. Model policies (`mgwfbp`, `mgwfbp-greedy`, `dear-model`)
start on fixed buckets, ask for a profile of the first steps and plan from it; `bayes` times
trials of bucket sizes; a plan file or a resumed checkpoint decides at once. `request_replan()`
starts deciding again (e.g. after the network changed), as often as asked.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any, Callable, Optional, Sequence

from commsched.comm.buckets import param_infos
from commsched.comm.links import Link
from commsched.fusion import MODEL_POLICIES, ParamInfo, plan_fixed, plan_layers
from commsched.options import FusionOptions, TuningOptions
from commsched.planning.auto_fusion import PLANNED, AutoFusion, FusionPhase
from commsched.planning.bayes import BucketSizeTuner
from commsched.planning.model_plans import plan_from_profile
from commsched.planning.plan_file import SavedPlan
from commsched.run_files import folder_of
from commsched.say import say

Planner = Callable[[Sequence[ParamInfo]], list[list[int]]]
ADAPTIVE = (*MODEL_POLICIES, "bayes", "auto")
"""Policies that decide during the run (the others build their layout at once)."""
PLAN_FILE_NAME = "commsched_plan.json"


class PlanPolicy:
    def __init__(
        self,
        fusion: FusionOptions,
        tuning: TuningOptions,
        seed: int = 0,
        planner: str = "mgwfbp",
        hand_over_planners: Sequence[str] = (),
    ) -> None:
        """`planner`: the model policy `fusion="auto"` plans with (the schedule's own, `Schedule.planner`);
        `hand_over_planners`: those of the schedules it may hand its iterations to, planned from the same profile."""
        self.fusion = fusion
        self.tuning_options = tuning
        self.decided: Optional[SavedPlan] = SavedPlan.load(fusion.plan_file) if fusion.plan_file else None
        self.trials: list[dict[str, float]] = []
        self._seed = seed
        self._adaptive = fusion.policy in ADAPTIVE
        self.auto: Optional[AutoFusion] = AutoFusion(fusion, planner) if fusion.policy == "auto" else None
        self._replan = False
        self._announce_pending = False
        self._fixed_plan: Optional[SavedPlan] = None
        self._hand_over_planners = tuple(p for p in dict.fromkeys(hand_over_planners) if p != planner)
        self._hand_over_planned: dict[str, SavedPlan] = {}
        """Per planner: its layout from the run's profile, run only while the run's own plan is kept (`layout_for`)."""
        self.compiled = False
        """The module runs under torch.compile (set by the engine): its backward is one compiled graph that
        hands every gradient over at its end, so no bucket plan can overlap it, and timing layers would
        break the graph. `fusion="auto"` keeps fixed buckets then."""
        self.sparse = False
        """The schedule exchanges top-k of each bucket (set by the engine): which elements are sent depends
        on how parameters share buckets, so a layout chosen by timings would make the trained model
        depend on them (and the planners model dense all-reduces). `fusion="auto"` keeps fixed buckets then."""
        self._start_tuning()

    def _start_tuning(self) -> None:
        bayes = self.fusion.policy == "bayes"
        self._cap_mb = self.tuning_options.first_mb if bayes else self.fusion.bucket_cap_mb
        self._tuner = BucketSizeTuner(self.tuning_options, seed=self._seed) if bayes else None
        self._timing: list[float] = []
        self._batches_in_trial = 0
        self._last_start: Optional[float] = None
        self._final_pending = False

    @property
    def deciding(self) -> bool:
        return self._adaptive and self.decided is None

    @property
    def wants_profile(self) -> bool:
        """A model policy still waiting for the profile it plans from."""
        if self.auto is not None:
            return self.deciding and self.auto.wants_profile and not self.compiled and not self.sparse
        return self.deciding and self.fusion.policy in MODEL_POLICIES

    @property
    def comparing(self) -> bool:
        """Fixed and planned buckets take turns (the first comparison, or a later check of the kept layout)."""
        return self.auto is not None and self.auto.turns is not None

    def planner(self) -> Planner:
        auto = self.auto
        if auto is not None and auto.candidate is not None and (self.comparing or self.decided is None):
            if auto.arm == PLANNED:
                return auto.candidate.planner()
            return partial(plan_fixed, cap_bytes=int(self._cap_mb * 2**20))
        if self.decided is not None:
            return self.decided.planner()
        if self.fusion.policy == "layers":
            return partial(plan_layers, layers_per_bucket=self.fusion.bucket_layers)
        return partial(plan_fixed, cap_bytes=int(self._cap_mb * 2**20))

    def layout_for(self, planner: str) -> Optional[SavedPlan]:
        """The buckets a schedule planned by `planner` runs on when the run hands it the iterations: where
        the run's own plan measured faster than fixed buckets on real steps, the layout that planner makes
        from the same profile (DeAR sizes buckets for two halves, each hidden behind a different pass; WFBP
        for one all-reduce hidden behind backward), or fixed buckets where its model predicts no gain.
        Where the run kept fixed buckets, the planners' model did not hold on this run, and a layout from
        it that no step has measured would run unchecked: the hand-over runs on the fixed buckets too, as
        it does where the run's own plan was the fixed layout (nothing was measured then either).
        None: the run's own buckets."""
        verdict = self.auto.verdict if self.auto is not None else None
        return self._hand_over_planned.get(planner) if verdict is not None and verdict.keep == PLANNED else None

    def request_replan(self) -> None:
        """Decide again from the next boundary on (a plan file or checkpoint plan is given up too)."""
        self._replan = True

    # ------------------------------------------------------------ at a boundary
    def at_boundary(self, strategy: Any, iteration_start: bool = True) -> bool:
        """Called at every training batch start on every rank; True: rebuild the buckets now.
        `iteration_start`: False on the later micro-batches of an accumulated step."""
        if self._replan:
            self._replan = False
            self.decided = None
            self._adaptive = (
                self.fusion.policy in ADAPTIVE
            )  # a fixed or layers policy has nothing to decide: its layout again
            self._start_tuning()
            if self.auto is not None:
                self.auto.reopen(strategy.profile)
            self._hand_over_planned = {}  # planned again with the run's own layout
            return True
        if self.auto is not None:
            return self._auto_step(strategy, iteration_start)
        if not self.deciding:
            return False
        if self.fusion.policy in MODEL_POLICIES:
            return self._plan_from_profile(strategy)
        return self._bayes_step(strategy)

    def _plan_from_profile(self, strategy: Any) -> bool:
        profile = strategy.profile
        if profile is None:
            return False  # still profiling
        link: Link = strategy.control_link
        mine = vars(plan_from_profile(profile, self.fusion.policy)) if link.rank == 0 else None
        self.decided = SavedPlan(**link.broadcast_object(mine, 0, "plan-decision"))
        self._announce(strategy)
        return True

    def _auto_step(self, strategy: Any, iteration_start: bool) -> bool:
        """`fusion="auto"`: profile, plan, confirm against the fixed layout on real steps, watch for drift.
        A finished profile is planned from at once (so no second profile starts); the layouts switch,
        and steps are timed, only at iteration starts."""
        auto = self.auto
        assert auto is not None
        link: Link = strategy.control_link
        if not iteration_start and auto.phase is not FusionPhase.PROFILE:
            return False
        if self.decided is not None and auto.turns is None:
            if auto.verdict is None or (not auto.recheck_due() and not auto.drifted(link)):
                return False
        if self.decided is not None and auto.turns is None:  # drifted (a later check has started its turns otherwise)
            say(
                f"commsched fusion: steps have become more than {self.fusion.drift:.0%} slower than the kept layout "
                "measured: deciding the buckets again"
            )
            auto.reopen(strategy.profile)
            self.decided, self._hand_over_planned = None, {}
            return True  # back to fixed buckets, profiled afresh
        if strategy.world_size == 1 or self.compiled or self.sparse:  # nothing to plan for (see `compiled`, `sparse`)
            self.decided = self._current(strategy, "fixed")
            auto.decided_without_confirming()
            if self.compiled:
                say(
                    "commsched fusion: the model runs under torch.compile, whose backward hands every gradient over at "
                    "its end: fixed buckets (a bucket plan could not overlap them)"
                )
            elif self.sparse and strategy.world_size > 1:
                say(
                    "commsched fusion: top-k selects within each bucket, so the buckets stay fixed: a layout chosen by "
                    "timings would make what is sent, and the trained model, depend on them"
                )
            return False
        if auto.phase is FusionPhase.PROFILE:
            profile = auto.fresh_profile(strategy.profile)
            if profile is None:
                return False  # still profiling
            cap = self.fusion.bucket_cap_mb * 2**20
            fixed = self._current(strategy, "fixed")
            mine = self._plans_from(profile, cap, fixed) if link.rank == 0 else None
            plans = link.broadcast_object(mine, 0, "auto-plan")
            candidate = SavedPlan(**plans[auto.planner])
            self._hand_over_planned = {p: SavedPlan(**plans[p]) for p in self._hand_over_planners}
            auto.steps_deciding += profile["profiled_steps"]  # on a GPU more than asked for (the profiler's own)
            if candidate.buckets == fixed.buckets:
                self.decided = fixed
                auto.decided_without_confirming()
                self._announce(strategy)
                return False
            self._fixed_plan = fixed
            auto.start_confirming(candidate)
            if not iteration_start:
                return False
        if auto.next_arm() is not None:
            return True
        assert auto.turns is not None
        if not auto.turns.done:
            return False
        verdict = auto.conclude(link)
        if verdict is None:  # the steps lean against the model within their noise: more turns
            return auto.next_arm() is not None
        kept = auto.candidate if verdict.keep == PLANNED else self._fixed_plan
        assert kept is not None
        kept.details = {
            **kept.details,
            "auto": {
                "planner": auto.planner,
                "kept": "planned" if verdict.keep == PLANNED else "fixed",
                "step_ms": [s * 1e3 for s in verdict.medians_s],
                "margin": verdict.margin,
                "predicted_ms": [s * 1e3 for s in verdict.predicted_s] if verdict.predicted_s else None,
                "steps_deciding": auto.steps_deciding,
            },
        }
        self.decided = kept
        if auto.arm == verdict.keep:
            self._announce(strategy)
            return False
        self._announce_pending = True
        return True

    def _plans_from(self, profile: dict, cap_bytes: float, fixed: SavedPlan) -> dict[str, dict[str, Any]]:
        """Rank 0: the candidate, and the layout of each schedule the run may hand over to (theirs where
        their model predicts it faster than fixed buckets, else fixed)."""
        plans = {self.auto.planner: vars(plan_from_profile(profile, self.auto.planner, fixed_cap_bytes=cap_bytes))}
        for planner in self._hand_over_planners:
            planned = plan_from_profile(profile, planner, fixed_cap_bytes=cap_bytes)
            fixed_s = planned.details.get("fixed_predicted_s")
            faster = planned.predicted_s is not None and fixed_s is not None and planned.predicted_s < fixed_s
            plans[planner] = vars(planned if faster else fixed)
        return plans

    @staticmethod
    def _current(strategy: Any, policy: str) -> SavedPlan:
        """The buckets the strategy runs now, as a plan."""
        names = [list(b.names) for b in strategy.bucket_plan.buckets]
        return SavedPlan(policy, strategy.world_size, names)

    def _bayes_step(self, strategy: Any) -> bool:
        now = time.perf_counter()
        if self._last_start is not None and self._batches_in_trial > self.tuning_options.warmup_steps:
            self._timing.append(now - self._last_start)
        self._last_start = now
        self._batches_in_trial += 1
        if len(self._timing) < self.tuning_options.trial_steps:
            return False
        link: Link = strategy.control_link
        decision = self._bayes_decide(strategy) if link.rank == 0 else None
        step_s, chosen, final = link.broadcast_object(decision, 0, "bayes-decision")
        self.trials.append({"trial": len(self.trials), "bucket_mb": self._cap_mb, "step_ms": step_s * 1e3})
        _log(
            strategy,
            {"bayes/trial": len(self.trials) - 1, "bayes/bucket_mb": self._cap_mb, "bayes/step_ms": step_s * 1e3},
        )
        say(
            f"commsched bayes: trial {len(self.trials) - 1}: {self._cap_mb:.2f} MB buckets, "
            f"median step {step_s * 1e3:.1f} ms"
        )
        if final and len(self.trials) < self.tuning_options.trials:  # after the trial's own line, in order
            say(
                f"commsched bayes: every size proposed gives buckets already measured; "
                f"stopping after {len(self.trials)} of {self.tuning_options.trials} trials"
            )
        self._cap_mb = chosen
        self._timing, self._batches_in_trial, self._last_start = [], 0, None
        self._final_pending = final
        return True

    def _bayes_decide(self, strategy: Any) -> tuple[float, float, bool]:
        """Rank 0: record this trial, propose the next size (or the best one, when done)."""
        assert self._tuner is not None
        self._tuner.layout_of = partial(_fixed_layout, strategy.lightning_module)
        step = statistics.median(self._timing)
        self._tuner.record(self._cap_mb, step)
        proposed = None if self._tuner.done else self._tuner.next_size()
        final = proposed is None
        return step, self._tuner.best().bucket_mb if final else proposed, final

    def rebuilt(self, strategy: Any) -> None:
        """After the strategy rebuilt its buckets: a final Bayesian choice becomes the decided plan."""
        if self._announce_pending:
            self._announce_pending = False
            self._announce(strategy)
        if not self._final_pending:
            return
        self._final_pending = False
        names = [list(b.names) for b in strategy.bucket_plan.buckets]
        self.decided = SavedPlan(
            "bayes", strategy.world_size, names, details={"bucket_mb": self._cap_mb, "trials": self.trials}
        )
        self._announce(strategy)

    def _announce(self, strategy: Any) -> None:
        assert self.decided is not None
        plan = self.decided
        if strategy.global_rank == 0:
            folder = folder_of(strategy.loop)
            path = folder / PLAN_FILE_NAME if folder is not None else None
            if path is not None:
                plan.save(path)
            saved = (
                f"saved to {path}"
                if path is not None
                else "not saved: the run has no folder (no logger, no checkpoints)"
            )
            sizes = sum(p.nbytes for p in param_infos(strategy.lightning_module)) / 2**20 / max(len(plan.buckets), 1)
            predicted = f", predicted {plan.predicted_s * 1e3:.1f} ms/step" if plan.predicted_s else ""
            if self.auto is not None:
                say(
                    f"commsched fusion: {self.auto.describe()}: {len(plan.buckets)} bucket(s) of {sizes:.2f} MB "
                    f"on average; {saved}"
                )
            else:
                say(
                    f"commsched: fusion '{plan.policy}' chose {len(plan.buckets)} bucket(s) of "
                    f"{sizes:.2f} MB on average{predicted}; {saved}"
                )

    # ---------------------------------------------------- communication state
    def state_dict(self) -> dict[str, Any]:
        return {
            "decided": vars(self.decided) if self.decided is not None else None,
            "trials": list(self.trials),
            "auto": self.auto.state_dict(self._fixed_plan) if self.auto is not None else None,
            "hand_over_planned": {p: vars(plan) for p, plan in self._hand_over_planned.items()},
        }

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """A plan decided before the checkpoint is kept (no tuning again); a plan file or a fixed policy given now
        wins."""
        if not state or self.fusion.plan_file or not self._adaptive:
            return
        self.trials = list(state.get("trials", []))
        if state.get("decided") is not None:
            self.decided = SavedPlan.from_dict(state["decided"])
            if self.auto is not None and state.get("auto") is not None:  # its later checks and drift watch go on
                self._fixed_plan = self.auto.load_state_dict(state["auto"])
            # saved before the hand-over followed the run's verdict: the same layouts, under their old name
            planned = state.get("hand_over_planned", state.get("hand_over_layouts", {}))
            self._hand_over_planned = {
                p: SavedPlan.from_dict(plan) for p, plan in planned.items() if p in self._hand_over_planners
            }


def _fixed_layout(module: Any, bucket_mb: float) -> tuple[tuple[int, ...], ...]:
    """The buckets `bucket_mb` gives this model: sizes with equal layouts are the same trial."""
    return tuple(map(tuple, plan_fixed(param_infos(module), cap_bytes=int(bucket_mb * 2**20))))


def _log(strategy: Any, metrics: dict[str, float]) -> None:
    trainer = strategy.loop
    if trainer.logger is not None and strategy.global_rank == 0:
        trainer.logger.log_metrics(metrics, step=trainer.global_step)
