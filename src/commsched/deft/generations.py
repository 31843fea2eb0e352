"""DeFT's generations: the gradients of one or more iterations, summed in buffers of their own.

A generation owns one flat buffer per bucket (never the capture's buffers, which the next
backward overwrites), the number k of iterations summed into it, which items of it were sent and
the collectives still in flight. Buffers of finished generations are reused by later ones.
"""

from __future__ import annotations

from typing import Any

import torch

from commsched.comm.buckets import BucketPlan
from commsched.comm.links import Link, Pending
from commsched.deft.plan import DeFTPlan, Item, Launch
from commsched.errors import CommSchedConfigError, ScheduleError
from commsched.reducers import AllReduce
from commsched.say import say


class Generation:
    def __init__(self, number: int, buffers: list[torch.Tensor], plan: BucketPlan) -> None:
        self.number = number
        self.buffers = buffers
        self.k = 0
        self.sent: set[int] = set()
        self.works: list[Pending] = []
        self.used: list[list[bool]] = [[False] * len(b.params) for b in plan.buckets]
        self.joined_at = 0
        """Optimizer steps the run had taken when its newest iteration's gradient was taken: the steps
        taken since are how late it is applied."""

    def merge(self, bucket: int, gradient: torch.Tensor, first: bool) -> None:
        """Add this iteration's (already 1/P-scaled) gradient of `bucket`; the first iteration copies."""
        if first:
            self.buffers[bucket].copy_(gradient)
        else:
            self.buffers[bucket].add_(gradient)

    def drain(self) -> None:
        """Wait for every collective in flight (a flush point: nothing else changes)."""
        for work in self.works:
            work.wait()
        self.works.clear()

    def views(self, plan: BucketPlan, bucket: int) -> list[torch.Tensor]:
        b = plan.buckets[bucket]
        return [self.buffers[bucket].narrow(0, start, p.numel()).view_as(p) for p, start in zip(b.params, b.offsets())]

    def hand_to_optimizer(self, plan: BucketPlan, items: int) -> None:
        """Every item is reduced: average over the k iterations and make `.grad` a view of the result
        (None where no rank produced a gradient in any of them), as DDP would for one step of batch kB.
        A generation missing any of its `items` pieces is refused: stepping on it would apply a
        gradient that was never averaged over the ranks."""
        missing = sorted(set(range(items)) - self.sent)
        if missing:
            raise ScheduleError(
                f"commsched deft: generation {self.number} is due to step but items {missing[:8]} of its "
                f"{items} were never sent; the plan is inconsistent"
            )
        self.drain()
        if self.k > 1:
            for buffer in self.buffers:
                buffer.div_(self.k)
        for b, bucket in enumerate(plan.buckets):
            for param, view, used in zip(bucket.params, self.views(plan, b), self.used[b]):
                param.grad = view if used else None

    # ------------------------------------------------------------ checkpoints
    def state(self, plan: BucketPlan) -> dict[str, Any]:
        names = [n for b in plan.buckets for n in b.names]
        grads = [v for b in range(len(plan.buckets)) for v in self.views(plan, b)]
        used = [u for per_bucket in self.used for u in per_bucket]
        return {
            "number": self.number,
            "k": self.k,
            "sent": sorted(self.sent),
            "joined_at": self.joined_at,
            "grads": {n: g.clone() for n, g in zip(names, grads)},
            "used": dict(zip(names, used)),
        }

    @classmethod
    def restore(cls, saved: dict[str, Any], buffers: list[torch.Tensor], plan: BucketPlan) -> "Generation":
        generation = cls(saved["number"], buffers, plan)
        generation.k = saved["k"]
        generation.joined_at = saved.get("joined_at", 0)
        generation.sent = set(saved["sent"])
        for b, bucket in enumerate(plan.buckets):
            for slot, (name, view) in enumerate(zip(bucket.names, generation.views(plan, b))):
                view.copy_(saved["grads"][name])
                generation.used[b][slot] = bool(saved["used"][name])
        return generation


class BufferPool:
    """Flat buffers shaped like the buckets', handed out per generation and returned when it steps.

    A returned set is reused only once no parameter's `.grad` is a view of it any more (Lightning's
    `zero_grad` before the next step sets them to None): until then, a `.grad` read after the step
    (a callback, a logger of gradient norms) keeps the values it stepped with."""

    def __init__(self, plan: BucketPlan) -> None:
        self._plan = plan
        self._free: list[list[torch.Tensor]] = []
        self._returned: list[list[torch.Tensor]] = []

    def take(self) -> list[torch.Tensor]:
        self._recycle()
        if self._free:
            return self._free.pop()
        return [torch.zeros_like(b.buffer) for b in self._plan.buckets]

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        self._returned.append(buffers)

    def _recycle(self) -> None:
        if not self._returned:
            return
        viewed = {
            p.grad.untyped_storage().data_ptr() for b in self._plan.buckets for p in b.params if p.grad is not None
        }
        for buffers in list(self._returned):
            if not any(buffer.untyped_storage().data_ptr() in viewed for buffer in buffers):
                self._returned.remove(buffers)
                self._free.append(buffers)


class ItemSender:
    """Starts the all-reduce of one planned item (a piece of one bucket) of a generation on a link,
    once per item and generation, with one reducer per pooled buffer and link (a gloo link serving a
    CUDA model stages through pinned host memory made once, not per send)."""

    def __init__(self) -> None:
        self._reducers: dict[tuple[int, str], AllReduce] = {}

    def send(self, generation: Generation, index: int, item: Item, link: Link) -> None:
        if index in generation.sent:
            raise ScheduleError(f"commsched deft: item {index} of generation {generation.number} planned twice")
        generation.sent.add(index)
        buffer = generation.buffers[item.bucket]
        key = (id(buffer), link.name)
        if key not in self._reducers:
            self._reducers[key] = AllReduce(buffer, link)
        generation.works.append(
            self._reducers[key].start(f"g{generation.number}.b{item.bucket}.{item.start}", item.start, item.numel)
        )


class InFlight:
    """The generations joined and not yet stepped, by number: their pooled buffers and the sends of
    their items."""

    def __init__(self, plan: BucketPlan) -> None:
        self._plan = plan
        self.generations: dict[int, Generation] = {}
        self._pool = BufferPool(plan)
        self._sender = ItemSender()

    def __bool__(self) -> bool:
        return bool(self.generations)

    def __contains__(self, number: int) -> bool:
        return number in self.generations

    def __getitem__(self, number: int) -> Generation:
        return self.generations[number]

    def in_order(self) -> list[int]:
        return sorted(self.generations)

    def joined(self, number: int) -> Generation:
        """Generation `number`, begun with buffers from the pool when this iteration is its first."""
        if number not in self.generations:
            self.generations[number] = Generation(number, self._pool.take(), self._plan)
        return self.generations[number]

    def launch(self, launches: list[Launch], plan: DeFTPlan, links: list[Link], iteration: int) -> None:
        """The plan's sends of this stage, in its order."""
        for launch in launches:
            if launch.generation not in self.generations:
                raise ScheduleError(
                    f"commsched deft: the plan sends generation {launch.generation} before any iteration "
                    f"joined it (iteration {iteration}); the plan is inconsistent: {plan.describe()}"
                )
            self._sender.send(
                self.generations[launch.generation], launch.item, plan.items[launch.item], links[launch.link]
            )

    def send_the_rest(self, number: int, items: list[Item], link: Link) -> None:
        """Every item of generation `number` not sent yet, in item order (the same on every rank)."""
        generation = self.generations[number]
        for index, item in enumerate(items):
            if index not in generation.sent:
                self._sender.send(generation, index, item, link)

    def release(self, number: int) -> None:
        """It stepped (or is dropped): its buffers go back to the pool."""
        self._pool.give_back(self.generations.pop(number).buffers)

    def wait(self) -> None:
        """Every collective launched completes (on every rank: they were launched on every rank)."""
        for generation in self.generations.values():
            generation.drain()

    def drop(self) -> None:
        """Waited for, then forgotten without stepping (the same on every rank)."""
        self.wait()
        for number in self.in_order():
            self.release(number)

    def state(self) -> list[dict[str, Any]]:
        return [g.state(self._plan) for g in self.generations.values()]

    def restore(self, saved: list[dict[str, Any]]) -> None:
        for one in saved:
            self.generations[one["number"]] = Generation.restore(one, self._pool.take(), self._plan)


def same_layout(state: dict[str, Any], plan: BucketPlan, quiet: bool = False) -> bool:
    """The saved DeFT state was written for these buckets. Otherwise its delayed gradients are refused
    (their pieces were sent by the old layout's items); without any, measuring starts again, said in
    a line unless `quiet` (the layouts tried while the buckets are decided)."""
    sizes = [b.buffer.numel() for b in plan.buckets]
    if state.get("bucket_numels") == sizes:
        return True
    if state.get("generations"):
        raise CommSchedConfigError(
            "commsched deft: the checkpoint holds delayed gradients for another bucket layout "
            f"(bucket sizes {state.get('bucket_numels')}, now {sizes}); resume with the bucket settings that wrote it "
            "(bucket_cap_mb, fusion), or from a checkpoint written at the end of training, where none are left"
        )
    if not quiet:
        say("commsched deft: the buckets changed; measuring and solving again for the new ones")
    return False
