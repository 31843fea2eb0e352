"""Deep Gradient Compression's corrections to a sparse exchange under SGD (Lin et al., ICLR 2018, §3.2-3.3).

Error feedback alone keeps what a rank did not send and sends it later. Under momentum that goes
wrong: a coordinate held back for many steps lands as one large gradient, and the optimizer's
momentum then keeps applying it for many more steps. DGC moves the momentum before the exchange:

- **momentum correction**: each rank keeps its own velocity `u <- m u + g` (Nesterov:
  `u <- m (u + g)`, and `u + g` is accumulated), accumulates it into its residual `v <- v + u` and
  selects from `v`. The optimizer then steps with momentum 0: what it receives already moved with
  momentum. Momentum is linear, so a dense exchange of every rank's `u` is exactly SGD with momentum
  on the averaged gradient;
- **momentum factor masking** (an option, off by default): where a coordinate was sent, `u` is
  cleared as well as `v`, so momentum that is now stale does not push it again. Without it the
  updates sent add up to exactly what SGD with momentum applies, only later; with it a coordinate
  sent often loses most of its momentum, and on every digits run measured it cost accuracy;
- **weight decay before accumulation**: the optimizer's decay joins each rank's gradient before
  anything is accumulated (PaddlePaddle's DGC lost 2 points of top-1 until it moved there), and the
  optimizer steps with weight decay 0;
- **local gradient clipping**: with the run's gradient clipping by norm C, each rank clips each
  parameter's gradient to C / sqrt(P) before accumulation (the sum of P such gradients then has about
  the norm C), and the exchanged update is not clipped again. Per parameter, as DGC's public code
  does: a bucket-wide norm would change with the fusion plan.

The momentum, Nesterov flag and weight decay are read from the user's SGD param groups at every
step, so schedulers that move them (one-cycle momentum) keep working; other optimizers get none of
this (error feedback alone). Everything here works in a bucket's units: gradients already scaled by
1/P on capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from commsched.comm.buckets import Bucket


@dataclass(frozen=True)
class SGDTerms:
    """What the user's SGD does to one parameter, read from its param group."""

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


NONE = SGDTerms()


def corrected(optimizer: Optimizer) -> bool:
    """Whether DGC's corrections can stand in for this optimizer's momentum and weight decay: torch's
    SGD (or a subclass) without dampening or maximize, whose update is then the plain step."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        not group.get("dampening", 0) and not group.get("maximize", False) for group in optimizer.param_groups
    )


class OptimizerTerms:
    """Each parameter's SGD terms, from whichever of the run's optimizers holds it (read when asked:
    schedulers change them between steps). Parameters of other optimizers have none."""

    def __init__(self, optimizers: Callable[[], Sequence[Optimizer]]) -> None:
        self.optimizers = optimizers
        self._groups: Optional[dict[int, dict]] = None

    def _group_of(self, param: nn.Parameter) -> Optional[dict]:
        if self._groups is None:
            self._groups = {
                id(p): group
                for opt in self.optimizers()
                if corrected(opt)
                for group in opt.param_groups
                for p in group["params"]
            }
        return self._groups.get(id(param))

    def refresh(self) -> None:
        """Read the param groups afresh at the next question (a group added, an optimizer state loaded)."""
        self._groups = None

    def covers(self, param: nn.Parameter) -> bool:
        """Whether an SGD the corrections stand in for steps this parameter."""
        return self._group_of(param) is not None

    def of(self, param: nn.Parameter) -> SGDTerms:
        group = self._group_of(param)
        if group is None:
            return NONE
        return SGDTerms(
            float(group.get("momentum", 0.0)), bool(group.get("nesterov", False)), float(group.get("weight_decay", 0.0))
        )


@dataclass(frozen=True)
class Run:
    """A stretch of a window whose parameters share momentum and Nesterov flag."""

    start: int
    length: int
    momentum: float
    nesterov: bool


class LocalCorrections:
    """On a rank's own bucket before anything leaves it: clipping, then weight decay (the order of a
    dense step: Lightning clips the gradient, then SGD adds the decay)."""

    def __init__(
        self, bucket: Bucket, terms: OptimizerTerms, world_size: int, clip_norm: Optional[float], decay: bool
    ) -> None:
        self.bucket = bucket
        self._terms = terms
        self._world = world_size
        self._clip = clip_norm / math.sqrt(world_size) if clip_norm else None
        self._decay = decay
        self._views = [bucket.buffer.narrow(0, start, p.numel()) for p, start in zip(bucket.params, bucket.offsets())]

    @property
    def active(self) -> bool:
        return self._clip is not None or self._decay

    def apply(self) -> None:
        if self._clip is not None:
            # the parameters of SGDs the corrections stand in for (Lightning clips the others' averaged gradients)
            clipped = [view for view, p in zip(self._views, self.bucket.params) if self._terms.covers(p)]
            if clipped:
                # the bucket holds g / P: a parameter's local gradient norm is P times its view's
                norms = torch._foreach_norm(clipped)
                scales = [torch.clamp(self._clip / (n * self._world + 1e-6), max=1.0) for n in norms]
                torch._foreach_mul_(clipped, scales)
        if self._decay:
            for view, param in zip(self._views, self.bucket.params):
                decay = self._terms.of(param).weight_decay
                if decay:
                    view.add_(param.detach().reshape(-1), alpha=decay / self._world)


class Velocity:
    """A rank's momentum `u` over one window of a bucket (the whole bucket, or the shard a two-level
    exchange selects in): `accumulate` turns the window's gradient into what joins the residual."""

    def __init__(self, bucket: Bucket, start: int, length: int, terms: OptimizerTerms) -> None:
        self.bucket = bucket
        self.start = start
        self.u = torch.zeros(length, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
        self._terms = terms
        self._key: Optional[tuple] = None
        self._runs: list[Run] = []

    def runs(self) -> list[Run]:
        """The window's runs of equal (momentum, Nesterov), rebuilt only when the param groups changed."""
        terms = [self._terms.of(p) for p in self.bucket.params]
        key = tuple((t.momentum, t.nesterov) for t in terms)
        if key != self._key:
            self._key, self._runs = key, list(_runs(self.bucket, terms, self.start, self.u.numel()))
        return self._runs

    def accumulate(self, x: torch.Tensor) -> None:
        """`x` (the window's gradient) becomes `u` after this step's update, or `u + g` under Nesterov."""
        for run in self.runs():
            if not run.momentum:
                continue  # u would be g: x is already what joins the residual
            u, g = self.u.narrow(0, run.start, run.length), x.narrow(0, run.start, run.length)
            if run.nesterov:
                u.add_(g).mul_(run.momentum)
                g.add_(u)
            else:
                u.mul_(run.momentum).add_(g)
                g.copy_(u)

    def mask(self, sent: torch.Tensor) -> None:
        """Momentum factor masking: no velocity is left where the window's elements were sent."""
        self.u[sent] = 0.0


def _runs(bucket: Bucket, terms: Iterable[SGDTerms], start: int, length: int) -> Iterable[Run]:
    """Parameters (clipped to the window) merged into runs of equal momentum and Nesterov flag; the
    bucket's padding carries momentum 0."""
    merged: list[Run] = []
    for param, offset, t in zip(bucket.params, bucket.offsets(), terms):
        lo, hi = max(offset, start) - start, min(offset + param.numel(), start + length) - start
        if lo >= hi:
            continue
        if (
            merged
            and merged[-1].momentum == t.momentum
            and merged[-1].nesterov == t.nesterov
            and merged[-1].start + merged[-1].length == lo
        ):
            last = merged[-1]
            merged[-1] = Run(last.start, hi - last.start, last.momentum, last.nesterov)
        else:
            merged.append(Run(lo, hi - lo, t.momentum, t.nesterov))
    return merged


@dataclass(frozen=True)
class Corrections:
    """The corrections a run's sparse exchanges apply, resolved from the options and the optimizers."""

    terms: OptimizerTerms
    momentum: bool
    """Momentum correction (each rank's velocity accumulated before selection)."""
    masking: bool
    """Momentum factor masking (with `momentum`)."""
    decay: bool
    """Weight decay joins the gradient before accumulation."""
    clip_norm: Optional[float]
    """The run's clipping norm C, applied per parameter on each rank as C / sqrt(P); None: no clipping."""

    def local(self, bucket: Bucket, world_size: int) -> Optional[LocalCorrections]:
        local = LocalCorrections(bucket, self.terms, world_size, self.clip_norm, self.decay)
        return local if local.active else None

    def velocity(self, bucket: Bucket, start: int, length: int) -> Optional[Velocity]:
        return Velocity(bucket, start, length, self.terms) if self.momentum else None


def describe_corrections(corrections: Corrections, optimizers: Sequence[Optimizer]) -> str:
    """One line: what the exchange applies and what the user's optimizer still does."""
    applied = [
        name
        for name, on in (
            ("momentum correction", corrections.momentum),
            ("momentum factor masking", corrections.momentum and corrections.masking),
            ("weight decay before accumulation", corrections.decay),
        )
        if on
    ]
    if corrections.clip_norm is not None:
        applied.append(
            f"local clipping to norm {corrections.clip_norm:g}/sqrt(P) per parameter "
            "(the exchanged update is not clipped again)"
        )
    sgd = [type(o).__name__ for o in optimizers if corrected(o)]
    others = [type(o).__name__ for o in optimizers if not corrected(o)]
    said = []
    if sgd:
        zeroed = " and ".join(
            n for n, on in (("momentum", corrections.momentum), ("weight decay", corrections.decay)) if on
        )
        said.append(
            f"DGC's corrections under {', '.join(sgd)}: {', '.join(applied)}; the optimizer steps with {zeroed} 0 "
            "(applied before the exchange), its learning rate and schedule as set"
        )
    if others:
        said.append(
            f"{', '.join(others)}: DGC's corrections apply to torch's SGD (without dampening or maximize) only: "
            "error feedback alone"
        )
    return "; ".join(said) if said else "DGC's corrections: no optimizer yet"


def export_momentum(
    optimizer: Optimizer, saved: dict, velocities: dict[int, torch.Tensor], terms: OptimizerTerms
) -> dict:
    """`saved` (the optimizer's `state_dict()`) with each parameter's `momentum_buffer` as torch's SGD holds it
    under ddp, from `velocities` (by parameter id: every rank's velocity summed, which is the velocity of the
    averaged gradient, momentum being linear). Under Nesterov the velocity carries the momentum factor once
    more (`u = m (u + g)` against SGD's `buf = m buf + g`). The SGD here steps with momentum 0 and never reads
    the buffer: it is written for a run that resumes from the checkpoint with the momentum in the optimizer
    (Lightning's ddp). The per-parameter dicts are copied, so the optimizer's own state stays as it was."""
    state = dict(saved["state"])
    for group, packed in zip(optimizer.param_groups, saved["param_groups"]):
        for param, index in zip(group["params"], packed["params"]):
            sgd = terms.of(param)
            if id(param) not in velocities or not sgd.momentum:
                continue
            buffer = velocities[id(param)].view_as(param)
            state[index] = {
                **state.get(index, {}),
                "momentum_buffer": buffer / sgd.momentum if sgd.nesterov else buffer,
            }
    return {**saved, "state": state}
