"""One optimizer step's update under DeAR, between the end of backward and the buckets' application
in the next forward: the all-gathers in flight (`Gathers`), the buckets still waiting
(`PendingUpdate`), and, after a failure elsewhere, what the step leaves behind (`taken_back`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch

from commsched.comm.links import InOrder, Links, Pending
from commsched.reducers.striped import StripedShards
from commsched.schedules.partial_step import StepUndo, SubsetStepper
from commsched.schedules.per_parameter import HyperParams


class Gathers:
    """One step's all-gathers: a chain per link (stream), each in the order the next forward needs
    its buckets; a bucket's units may lie on several chains."""

    def __init__(self, chains: dict[str, InOrder], position: dict[int, list[tuple[str, int]]]) -> None:
        self._chains = chains
        self._position = position  # bucket -> its units' chains and their places in them

    def wait(self, b: int) -> None:
        for chain, i in self._position[b]:
            self._chains[chain].wait(i)

    def done(self, b: int) -> bool:
        return all(self._chains[chain].done(i) for chain, i in self._position[b])


@dataclass
class PendingUpdate:
    """The update of one optimizer step, waiting to be applied bucket by bucket."""

    stepper: SubsetStepper
    step: Callable[[], Any]
    hyper: HyperParams
    gathers: Gathers
    clip: Optional[Callable[[torch.Tensor], Any]]  # Lightning's clipping, applied to each bucket once gathered
    waiting: list[bool]  # False once the bucket is applied
    undo: Optional[StepUndo]  # copies of buckets applied while others' all-gathers were on the network (None: not kept)
    kept: set[int]  # the buckets `undo` holds


def start_gathers(reducers: Sequence[StripedShards], links: Links, gather: Callable[[int, int, Optional[Pending]], Pending]) -> Gathers:
    """Request every bucket's all-gathers: one chain per link (stream), in the order the next forward
    needs the buckets (the last bucket first); `gather(b, u, previous)` starts unit u of bucket b
    once `previous` (the chain's last) is done."""
    chains: dict[str, list[tuple[int, int]]] = {}
    for b in reversed(range(len(reducers))):
        for u, link in enumerate(reducers[b].links):
            chains.setdefault(link.name, []).append((b, u))
    started = {name: links[name].in_order([partial(gather, b, u) for b, u in order]) for name, order in chains.items()}
    position: dict[int, list[tuple[str, int]]] = {}
    for name, order in chains.items():
        for i, (b, _) in enumerate(order):
            position.setdefault(b, []).append((name, i))
    return Gathers(started, position)


def landed(gathers: Gathers, b: int) -> bool:
    """Bucket `b`'s all-gathers completed intact (never waits): a failed one is left for whoever
    needs the bucket, so that its failure is raised there, before anything changes."""
    if not gathers.done(b):
        return False
    try:
        gathers.wait(b)
    except Exception:  # noqa: BLE001 - the backend's error, raised again where the bucket is needed
        return False
    return True


def taken_back(pending: PendingUpdate) -> Optional[str]:
    """A step still partly on the network when the run failed: taken back where the copies allow, so that
    the weights are those of one step; what the model holds, in a sentence."""
    applied = [b for b, waiting in enumerate(pending.waiting) if not waiting]
    before = ("the weights, buffers and optimizer state are those before that step, whole (the step count saved with "
              "them includes it)")
    if not applied:
        if pending.undo is not None:
            pending.undo.restore(pending.stepper.optimizer.state)  # buffers the forward since changed
        return f"the last optimizer step's update was not applied (its all-gathers did not complete): {before}"
    if pending.undo is not None and pending.kept.issuperset(applied):
        pending.undo.restore(pending.stepper.optimizer.state)
        return (f"the last optimizer step was taken back ({len(applied)} of {len(pending.waiting)} buckets had "
                f"applied it before the others' all-gathers failed): {before}")
    return (f"{len(applied)} of {len(pending.waiting)} buckets hold the last optimizer step's update and the others do "
            "not (their all-gathers failed; DeAROptions(rollback=False) kept no copies): these weights mix two "
            "steps; resume from the last checkpoint instead")
