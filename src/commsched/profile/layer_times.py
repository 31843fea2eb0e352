"""Per-layer forward and backward time of a model, measured with hooks during real steps.

A layer is a module that owns parameters directly (Conv2d, Linear, BatchNorm, Embedding, ...),
as everywhere in commsched. Forward time is the layer's exclusive time between its forward
pre-hook and post-hook (a parent's time excludes its parameter-owning children). Backward time is
what the simulator and the planners need: the interval between consecutive layers' gradients
becoming complete (post-accumulate-grad hooks), the first measured from the start of backward.
Times are wall clock once the device has finished: on a GPU every hook synchronizes the device
(the profiled steps run slower, but what is timed is the kernels, not their launch).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from commsched.comm.device_time import synchronize
from commsched.hooks import OwnHook
from commsched.sim.workload import Layer, Workload
from commsched.trace import Span


@dataclass
class _Owner:
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    nbytes: int
    forward: list[float] = field(default_factory=list)  # per step
    backward: list[float] = field(default_factory=list)


class LayerTimer:
    """`attach(module)`, then per step: `backward_started()` when backward begins and `end_step()`."""

    def __init__(self, module: nn.Module, device: torch.device = torch.device("cpu")) -> None:
        self._device = device
        seen: set[int] = set()
        self._owners: list[_Owner] = []
        for name, sub in module.named_modules():
            params = [p for p in sub.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            if params:
                nbytes = sum(p.numel() * p.element_size() for p in params)
                self._owners.append(_Owner(name or "(root)", sub, params, nbytes))
        self._first_called: list[int] = []
        self._stack: list[list[float]] = []  # [owner index, start, children's time]
        self._step_forward = [0.0] * len(self._owners)
        self._ready: dict[int, float] = {}
        self._pending = [len(o.params) for o in self._owners]
        self._backward_start: float | None = None
        self._handles: list[RemovableHandle] = []
        self.spans: list[Span] = []
        self.steps = 0

    def attach(self) -> "LayerTimer":
        for index, owner in enumerate(self._owners):
            self._handles.append(owner.module.register_forward_pre_hook(OwnHook(lambda *_, i=index: self._enter(i))))
            self._handles.append(
                owner.module.register_forward_hook(OwnHook(lambda *_, i=index: self._leave(i)), always_call=True)
            )
            for param in owner.params:
                self._handles.append(
                    param.register_post_accumulate_grad_hook(OwnHook(lambda _p, i=index: self._grad(i)))
                )
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def _enter(self, index: int) -> None:
        if not torch.is_grad_enabled():
            return  # validation and prediction forwards are not part of a training step
        if index not in self._first_called:
            self._first_called.append(index)
        self._stack.append([index, self._now(), 0.0])

    def _now(self) -> float:
        synchronize(self._device)
        return time.perf_counter()

    def _leave(self, index: int) -> None:
        if not self._stack:
            return  # a forward outside a training step (validation)
        end = self._now()
        while self._stack and self._stack[-1][0] != index:
            self._stack.pop()  # an exception skipped a post-hook
        if not self._stack:
            return
        _, start, children = self._stack.pop()
        self._step_forward[index] += end - start - children
        if self._stack:
            self._stack[-1][2] += end - start
        self.spans.append(Span("compute", f"F {self._owners[index].name}", start, end))

    def _grad(self, index: int) -> None:
        self._pending[index] -= 1
        if self._pending[index] == 0:
            self._ready[index] = self._now()

    def backward_started(self) -> None:
        if self._backward_start is None:
            self._backward_start = self._now()

    def end_step(self) -> None:
        """Close a step: turn this step's readiness times into per-layer backward seconds."""
        backward = [0.0] * len(self._owners)
        previous = self._backward_start
        for index, ready in sorted(self._ready.items(), key=lambda item: item[1]):
            if previous is not None:
                backward[index] = ready - previous
                self.spans.append(Span("compute", f"B {self._owners[index].name}", previous, ready))
            previous = ready
        for owner, fwd, bwd in zip(self._owners, self._step_forward, backward):
            owner.forward.append(fwd)
            owner.backward.append(bwd)
        self._step_forward = [0.0] * len(self._owners)
        self._ready.clear()
        self._pending = [len(o.params) for o in self._owners]
        self._backward_start = None
        self.steps += 1

    def layer_of_param(self) -> dict[int, str]:
        return {id(p): owner.name for owner in self._owners for p in owner.params}

    def forward_order(self) -> list[int]:
        called = list(self._first_called)
        return [i for i in range(len(self._owners)) if i not in called] + called

    def workload(
        self,
        name: str,
        batch_size: int,
        skip: int = 1,
        totals: tuple[float, float] | None = None,
        wire_element_size: int | None = None,
    ) -> Workload:
        """Median over the steps after the first `skip` (warm-up), layers in the order forward called them.
        `wire_element_size`: bytes each gradient element takes on the wire (`comm_dtype`), when not the
        parameters' own: a layer's bytes are what its gradients send.

        `totals`: measured (forward, backward) seconds of the whole step; layer times are scaled to
        them, spreading what no layer owns (activations, the loss, autograd bookkeeping) in
        proportion to each layer's own time, so the workload adds up to the real step."""
        if self.steps <= skip:
            raise RuntimeError(f"LayerTimer: {self.steps} steps recorded; need more than the {skip} warm-up step(s)")
        order = self.forward_order()
        forward = [statistics.median(self._owners[i].forward[skip:]) for i in order]
        backward = [statistics.median(self._owners[i].backward[skip:]) for i in order]
        if totals is not None:
            forward = _scaled(forward, totals[0])
            backward = _scaled(backward, totals[1])

        def sent(params: list) -> int:
            return sum(p.numel() * (wire_element_size or p.element_size()) for p in params)

        layers = [
            Layer(
                self._owners[i].name,
                sent(self._owners[i].params),
                f,
                b,
                sent([p for p in self._owners[i].params if p.dim() <= 1]),
            )
            for i, f, b in zip(order, forward, backward)
        ]
        return Workload(name, tuple(layers), batch_size)


def _scaled(values: list[float], total: float) -> list[float]:
    measured = sum(values)
    if measured <= 0:
        return [total / len(values)] * len(values)
    return [v * total / measured for v in values]
