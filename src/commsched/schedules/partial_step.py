"""Run the user's optimizer on a subset of its parameters, with hyper-parameters of an earlier moment.

DeAR applies the update of step t bucket by bucket during the forward of step t+1. By then
Lightning has already stepped the LR scheduler, so the update must use the hyper-parameters as
they were when step t was taken. For an optimizer that steps each parameter alone
(`per_parameter`: state keyed by parameter, parameters without `.grad` skipped), stepping bucket by
bucket with the snapshot gives exactly the update a single `optimizer.step()` at step t would have
made; any other optimizer is stepped whole, once every bucket's gradient is there.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from commsched.errors import ScheduleError
from commsched.schedules.per_parameter import HyperParams, StepMode, qualified_name, step_mode, step_with


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
            raise ScheduleError(f"commsched dear: {qualified_name(type(self.optimizer))} wrote {sorted(written)} into its param "
                                "groups while stepping part of its parameters: its step keeps group-level state, so it "
                                "cannot be stepped bucket by bucket; remove it from DeAROptions.per_parameter")


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
            before = {k: (self._copy(p, k, v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in state[p].items()} \
                if p in state else None
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
