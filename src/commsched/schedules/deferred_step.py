"""DeAR's deferred update, top to bottom: one optimizer step from the end of backward to the last
bucket applied in the next forward, and what is left of it when a peer fails.

1. Backward ends (`gradients_on_their_way`): each rank holds its shard of every bucket's averaged
   gradient and the all-gathers are on their way (`GatherWaits`); every `.grad` is marked pending
   (`commsched.schedules.pending_tensors`), so a read of one makes every gradient whole at once
   (`make_whole`), as DDP leaves them.
2. Lightning runs its optimizer step; `optimizer.step` is replaced for its duration
   (`replace_step`): the closure runs, then `step` takes the update at once (the fit's first step,
   or gradients someone made whole) or defers it (`_defer`): the hyper-parameters are snapshotted,
   each bucket's parameters and optimizer state are marked pending for their update.
3. The next forward applies each bucket before the first module that owns one of its parameters
   runs (`apply(b, "forward")`), or the first touch of a pending tensor from anywhere does
   (`apply(b, "touch")`); buckets whose all-gathers have landed go along in the same optimizer call.
   What the forward did not reach is applied after it (`flush`).
4. A peer fails while the step is partly applied (`take_back`): the copies kept of what was applied
   (`StepUndo`, `DeAROptions.rollback`) restore the weights of one step.

Below the class: how the user's optimizer steps part of its parameters with the hyper-parameters of
an earlier moment (`SubsetStepper`, `snapshot_hyperparams`) and the copies that take a step back.

The communication itself (reduce-scatters, the order of the all-gathers) is the schedule's
(`commsched.schedules.dear`); this class only waits for what it was handed.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from commsched.comm.buckets import BucketPlan
from commsched.errors import ScheduleError
from commsched.schedules.optimizer_step import (
    HyperParams,
    StepMode,
    qualified_name,
    run_with_step_replaced,
    step_mode,
    step_with,
)
from commsched.schedules.pending_tensors import Kind, PendingTensors


class GatherWaits(Protocol):
    """What the update waits on: one step's all-gathers as the schedule started them
    (`commsched.schedules.dear.Gathers`)."""

    def wait(self, b: int) -> None:
        """Until bucket `b`'s all-gathers have landed (re-raises their failure)."""

    def done(self, b: int) -> bool:
        """Bucket `b`'s all-gathers have completed (never waits)."""


@dataclass
class PendingUpdate:
    """The update of one optimizer step, waiting to be applied bucket by bucket."""

    stepper: SubsetStepper
    step: Callable[[], Any]
    hyper: HyperParams
    gathers: GatherWaits
    transforms: list[
        Callable[[torch.Tensor], Any]
    ]  # fp16's unscaling, Lightning's clipping: each bucket, once gathered
    waiting: list[bool]  # False once the bucket is applied
    undo: Optional[StepUndo]  # copies of buckets applied while others' all-gathers were on the network (None: not kept)
    kept: set[int]  # the buckets `undo` holds


class DeferredStep:
    """One schedule's deferred optimizer steps over the buckets of `plan`. `hand_back_gradients(buckets)`
    puts the reduced gradients of `buckets` in `.grad` (the schedule's, as DDP leaves them)."""

    def __init__(
        self,
        plan: BucketPlan,
        hand_back_gradients: Callable[[Iterable[int]], None],
        rollback: bool,
        per_parameter: Sequence[type],
    ) -> None:
        self.plan = plan
        self._hand_back_gradients = hand_back_gradients
        self._per_parameter = tuple(per_parameter)
        self.pending = PendingTensors(self._bring_up_to_date)
        """The tensors not up to date yet: `.grad` after backward, then each bucket's parameters and state."""
        self.gathers: Optional[GatherWaits] = None  # this step's all-gathers
        self.transforms: list[Callable[[torch.Tensor], Any]] = []
        """What the step does to the averaged gradients before the optimizer sees them (fp16's unscaling,
        then Lightning's clipping, in the order asked): applied to each bucket once gathered."""
        self._stepped = False  # the optimizer step of this backward's gradients was taken or deferred
        self.whole = False
        """This step's gradients were made whole (someone read `.grad`): the step is taken at once."""
        self._update: Optional[PendingUpdate] = None
        self._steps = 0
        self._stepper: Optional[SubsetStepper] = None
        self._undo: Optional[StepUndo] = StepUndo() if rollback else None
        self.rollback_peak_bytes = 0
        """The memory the copies hold (`DeAROptions.rollback`): kept from step to step, so the most any
        step's copies needed, and more where different steps copied different buckets."""
        self.applied: Counter[str] = Counter()
        """Buckets applied, by what brought them: "forward" (the module that needs them is about to run:
        the overlap DeAR is for), "touch", "after_forward", "flush", "unwatchable", "compiled" (before a
        torch.compile'd forward); "whole": steps whose gradients were made whole at once."""

    # ----------------------------------------------------------- 1. backward ends
    def gradients_on_their_way(self, gathers: GatherWaits) -> None:
        self.gathers, self.whole, self.transforms, self._stepped = gathers, False, [], False
        for b, bucket in enumerate(self.plan.buckets):
            self.pending.mark(b, bucket.params, Kind.GRADIENT)

    def _bring_up_to_date(self, buckets: set[int], kind: Kind) -> None:
        """The first touch of a pending tensor: its gradients made whole, or its buckets' update applied."""
        if kind is Kind.GRADIENT:
            self.make_whole()
        else:
            for b in sorted(buckets, reverse=True):
                self.apply(b, "touch")

    def make_whole(self) -> None:
        """Every gradient whole and in `.grad`, as DDP leaves them after backward."""
        self.pending.unmark_all()
        assert self.gathers is not None
        for b in reversed(range(len(self.plan.buckets))):
            self.gathers.wait(b)
            for transform in self.transforms:
                transform(self.plan.buckets[b].buffer)
        self._hand_back_gradients(range(len(self.plan.buckets)))
        self.whole, self.transforms = True, []
        self.applied["whole"] += 1

    def transform_all(self, transform: Callable[[torch.Tensor], Any]) -> None:
        """fp16's unscaling or Lightning's clipping: whole gradients now, gathered ones as each bucket is applied."""
        if self.whole:
            for bucket in self.plan.buckets:
                transform(bucket.buffer)
        else:
            self.transforms.append(transform)

    # ------------------------------------------------------ 2. the optimizer step
    def replace_step(self, optimizer: Optimizer, run_step: Callable[[], Any]) -> Any:
        """Let Lightning run closure, hooks and clipping; the update itself is `step`'s. A step not taken
        (fp16's scaler found an inf) leaves the gradients whole in `.grad`, as under DDP, and nothing
        of this step on the network when the next backward refills the buckets."""
        output = run_with_step_replaced(
            optimizer, run_step, lambda real_step, kwargs: self.step(optimizer, lambda: real_step(**kwargs))
        )
        if not self._stepped and self.gathers is not None and not self.whole:
            self.make_whole()
        return output

    def step(self, optimizer: Optimizer, real_step: Callable[[], Any]) -> None:
        """After the closure: take the step at once (gradients already whole, or the fit's first step, so
        that the optimizer's state exists from then on as under DDP) or defer it to the next forward."""
        if self._steps == 0 and not self.whole:
            self.make_whole()
        self._steps += 1
        self._stepped = True
        if self.whole:
            real_step()
        else:
            self._defer(optimizer, real_step)
        # The update is real (taken or on its way): keep torch's scheduler from warning that it stepped first.
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def _defer(self, optimizer: Optimizer, real_step: Callable[[], Any]) -> None:
        assert self.gathers is not None
        if self._stepper is None or self._stepper.key_at_build != SubsetStepper.key(optimizer):
            self._stepper = SubsetStepper(optimizer, [b.params for b in self.plan.buckets], self._per_parameter)
        self._update = PendingUpdate(
            self._stepper,
            real_step,
            snapshot_hyperparams(optimizer),
            self.gathers,
            list(self.transforms),
            [True] * len(self.plan.buckets),
            self._undo.begin() if self._undo is not None else None,
            set(),
        )
        state = optimizer.state
        unwatched = []
        for b, bucket in enumerate(self.plan.buckets):
            tensors = [
                *bucket.params,
                *(v for p in bucket.params if p in state for v in state[p].values() if isinstance(v, torch.Tensor)),
            ]
            if not self.pending.mark(b, tensors, Kind.UPDATE):
                unwatched.append(b)
        for b in unwatched:
            self.apply(b, "unwatchable")

    # ------------------------------------------------- 3. the next forward applies
    @property
    def in_flight(self) -> bool:
        """A deferred update still has buckets to apply."""
        return self._update is not None

    def apply(self, b: int, why: str) -> None:
        """Apply bucket `b`'s update, waiting for its all-gather; buckets whose all-gathers have
        landed already are applied in the same optimizer call. An optimizer that is not stepped
        bucket by bucket (`SubsetStepper.mode`) waits for every all-gather and steps whole."""
        with self.pending.lock:
            update = self._update
            if update is None or not update.waiting[b]:
                return
            split = update.stepper.mode.split
            ready = [b] + [
                c
                for c, waiting in enumerate(update.waiting)
                if waiting and c != b and (not split or landed(update.gathers, c))
            ]
            for c in ready if not split else [b]:
                update.gathers.wait(c)  # re-raises a failure before anything changes
            for c in ready:
                self.pending.unmark(c)  # before anything below reads its tensors
                update.waiting[c] = False
                for transform in update.transforms:
                    transform(self.plan.buckets[c].buffer)
            if update.undo is not None and any(update.waiting):  # others' all-gathers may still fail
                for c in ready:
                    update.undo.keep(self.plan.buckets[c].params, update.stepper.optimizer.state)
                update.kept.update(ready)
                self.rollback_peak_bytes = max(self.rollback_peak_bytes, update.undo.reserved_bytes)
            self._hand_back_gradients(ready)
            self.applied[why] += len(ready)
            update.stepper.step_buckets(ready, update.hyper, update.step)
            if not any(update.waiting):
                self._update = None

    def keep_buffers(self, module: nn.Module) -> None:
        """A module in training with saved buffers (BatchNorm's statistics) is about to run while a step is
        partly applied: copies of them, so that a step taken back takes back what this forward changed."""
        update = self._update
        if update is not None and update.undo is not None and module.training:
            update.undo.keep_buffers(
                [
                    b
                    for name, b in module._buffers.items()
                    if b is not None and name not in module._non_persistent_buffers_set
                ]
            )

    def flush(self, why: str = "flush") -> None:
        for b in reversed(range(len(self.plan.buckets))):
            self.apply(b, why)

    # ------------------------------------------------------- 4. a peer failed
    def take_back(self) -> Optional[str]:
        """A step still partly on the network is taken back (the copies `DeAROptions.rollback` keeps),
        so that the weights are those of one step. Taken back on every rank, even where the rest of
        its all-gathers happen to have landed: whether one has landed yet when the failure is noticed
        differs from rank to rank, and the surviving ranks must keep the same model."""
        with self.pending.lock:
            update, self._update = self._update, None
            if update is None:
                return None
            self.pending.unmark_all()  # what is left cannot be applied: reading the tensors must not try
            return taken_back(update)

    def forget(self) -> None:
        """The schedule lets go of the module (after a flush, or after a failure): nothing is applied here."""
        self.pending.unmark_all()

    def summary(self) -> list[str]:
        from commsched.say import size_text

        peak = max(self.rollback_peak_bytes, self._undo.reserved_bytes if self._undo is not None else 0)  # buffers too
        rollback = (
            [f"copies kept to take a step back on failure: at most {size_text(peak)} (DeAROptions.rollback)"]
            if peak
            else []
        )
        stepping = [self._stepper.mode.describe(self._stepper.optimizer)] if self._stepper is not None else []
        return stepping + rollback


def landed(gathers: GatherWaits, b: int) -> bool:
    """Bucket `b`'s all-gathers completed intact (never waits): a failed one is left for whoever
    needs the bucket, so that its failure is raised there, before anything changes."""
    if not gathers.done(b):
        return False
    try:
        gathers.wait(b)
    except Exception:  # noqa: BLE001 - the backend's error, raised again where the bucket is needed
        return False
    return True


def taken_back(update: PendingUpdate) -> Optional[str]:
    """A step still partly on the network when the run failed: taken back where the copies allow, so that
    the weights are those of one step; what the model holds, in a sentence."""
    applied = [b for b, waiting in enumerate(update.waiting) if not waiting]
    before = (
        "the weights, buffers and optimizer state are those before that step, whole (the step count saved with "
        "them includes it)"
    )
    if not applied:
        if update.undo is not None:
            update.undo.restore(update.stepper.optimizer.state)  # buffers the forward since changed
        return f"the last optimizer step's update was not applied (its all-gathers did not complete): {before}"
    if update.undo is not None and update.kept.issuperset(applied):
        update.undo.restore(update.stepper.optimizer.state)
        return (
            f"the last optimizer step was taken back ({len(applied)} of {len(update.waiting)} buckets had "
            f"applied it before the others' all-gathers failed): {before}"
        )
    return (
        f"{len(applied)} of {len(update.waiting)} buckets hold the last optimizer step's update and the others do "
        "not (their all-gathers failed; DeAROptions(rollback=False) kept no copies): these weights mix two "
        "steps; resume from the last checkpoint instead"
    )


# ------------------------------------------------ stepping part of the parameters
# The update of step t is applied bucket by bucket during the forward of step t+1. By then Lightning has
# already stepped the LR scheduler, so the update uses the hyper-parameters as they were when step t was
# taken. For an optimizer that steps each parameter alone (`per_parameter`: state keyed by parameter,
# parameters without `.grad` skipped), stepping bucket by bucket with the snapshot gives exactly the
# update a single `optimizer.step()` at step t would have made; any other optimizer is stepped whole,
# once every bucket's gradient is there.


def snapshot_hyperparams(optimizer: Optimizer) -> HyperParams:
    """Everything in each param group except the parameter list; tensors cloned (schedulers may mutate them)."""
    return [
        {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


class SubsetStepper:
    """Steps `optimizer` on some buckets' parameters (per-group subsets computed once per bucket), or
    whole where its class is not known to step each parameter alone (`mode`)."""

    def __init__(self, optimizer: Optimizer, buckets: list[list[nn.Parameter]], declared: Sequence[type] = ()) -> None:
        self.optimizer = optimizer
        self.key_at_build = self.key(optimizer)
        self.mode: StepMode = step_mode(optimizer, declared)
        group_members = [{id(p) for p in g["params"]} for g in optimizer.param_groups]
        self._subsets: list[list[list[nn.Parameter]]] = [
            [[p for p in params if id(p) in members] for members in group_members] for params in buckets
        ]

    @staticmethod
    def key(optimizer: Optimizer) -> tuple[int, ...]:
        """Changes when the optimizer's parameter lists change (e.g. `add_param_group`): subsets are then stale."""
        return (id(optimizer), *(len(g["params"]) for g in optimizer.param_groups))

    def step_buckets(self, buckets: list[int], hyper: HyperParams, step: Callable[[], Any]) -> None:
        """Call `step` (the optimizer's own, unwrapped by us) with only `buckets`' parameters visible:
        one call for several buckets costs the optimizer's per-call overhead once. An optimizer stepped
        whole (`mode`) is given every bucket at once, and steps over the user's own param groups."""
        if not self.mode.split:
            step_with(self.optimizer, hyper, step)
            return
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for index, g in enumerate(groups):
                g["params"] = [p for b in buckets for p in self._subsets[b][index]]
            written = step_with(self.optimizer, hyper, step)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
        if written:
            raise ScheduleError(
                f"commsched dear: {qualified_name(type(self.optimizer))} wrote {sorted(written)} into its param "
                "groups while stepping part of its parameters: its step keeps group-level state, so it "
                "cannot be stepped bucket by bucket; remove it from DeAROptions.per_parameter"
            )


class StepUndo:
    """Copies taken just before part of a step is applied, so that a step that cannot be completed
    (its other buckets' all-gathers failed) can be taken back: the parameters and their optimizer
    state, and the module buffers (BatchNorm's statistics) that the next forward changes while the
    step is still partly on the network. The model is then the one before the step, whole, rather
    than a mix of two steps. The copies' memory is allocated once and reused every step (`begin`),
    so keeping them costs the copy alone. (Group-level optimizer state needs no copy: an optimizer
    whose step writes any is stepped whole, after every all-gather landed.)"""

    def __init__(self) -> None:
        self._saved: list[tuple[nn.Parameter, torch.Tensor, Optional[dict[str, Any]]]] = []
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._spare: dict[tuple[int, str], torch.Tensor] = {}

    @property
    def reserved_bytes(self) -> int:
        """The memory the copies hold, kept from step to step."""
        return sum(t.numel() * t.element_size() for t in self._spare.values())

    def begin(self) -> "StepUndo":
        """A new step: nothing kept yet (the memory stays for this step's copies)."""
        self._saved.clear()
        self._buffers.clear()
        return self

    def _copy(self, p: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        spare = self._spare.get((id(p), key))
        if spare is None or spare.shape != value.shape or spare.dtype != value.dtype or spare.device != value.device:
            spare = self._spare[(id(p), key)] = torch.empty_like(value, memory_format=torch.preserve_format)
        return spare.copy_(value.detach())

    def keep(self, params: list[nn.Parameter], state: dict[Any, dict[str, Any]]) -> None:
        for p in params:
            before = (
                {
                    k: (self._copy(p, k, v) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                    for k, v in state[p].items()
                }
                if p in state
                else None
            )
            self._saved.append((p, self._copy(p, "", p), before))

    def keep_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Before a module that may change them runs (once a step each)."""
        for buffer in buffers:
            if id(buffer) not in self._buffers:
                self._buffers[id(buffer)] = (buffer, self._copy(buffer, "buffer", buffer))

    def restore(self, state: dict[Any, dict[str, Any]]) -> None:
        with torch.no_grad():
            for p, data, before in self._saved:
                p.copy_(data)
                if before is None:
                    state.pop(p, None)
                else:
                    state[p] = before
            for buffer, data in self._buffers.values():
                buffer.copy_(data)
        self._saved.clear()
        self._buffers.clear()
        self._spare.clear()  # the optimizer's state now holds some of them
