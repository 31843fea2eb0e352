"""Named process groups ("links") and the collectives a schedule issues on them.

Every collective goes through a `Link`, the one place that (a) picks the collective the installed
torch offers, (b) keeps the tensors it touches on the link's device (CUDA for NCCL, CPU for gloo),
(c) turns a failed or timed-out collective into a `PeerFailureError` that says which one and
why, (d) records the sequence of collectives a rank issued, which tests compare across ranks, and
(e) times what the training loop waited for. `Links` creates a run's links on every rank in the
same order. A collective returns a `Pending`; `then` chains a continuation that runs on the
backend's thread the moment the collective completes, not when someone waits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from commsched import exchange
from commsched.errors import PeerFailureError
from commsched.trace import Span

# torch 2.10+ renamed the tensor-in/tensor-out collectives; keep working on torch >= 2.3.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

log = logging.getLogger(__name__)

IFNAME_ENV = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
KNOWN_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
"""What a schedule's `step_collectives` may name: the collectives a `Link` issues and the profiler times."""


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by this rank: enough to prove every rank issued the same sequence."""

    link: str
    op: str
    tag: str
    numel: int
    dtype: str


@dataclass(frozen=True)
class LinkSpec:
    """How to make one link: its name, backend (None: the default group's) and network interface."""

    name: str
    backend: Optional[str] = None
    ifname: Optional[str] = None


class WaitClock:
    """Seconds the training loop spent blocked on a link: communication that did not overlap compute."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


class Pending:
    """An in-flight collective (and its continuations); `wait()` re-raises failures as `PeerFailureError`."""

    __slots__ = ("_work", "_future", "_what", "_clock", "_after")

    def __init__(self, work: Optional[dist.Work], what: str, clock: Optional[WaitClock] = None,
                 future: Optional[torch.futures.Future] = None) -> None:
        self._work = work
        self._future = future  # the last continuation, if any
        self._what = what
        self._clock = clock
        self._after: Optional[Pending] = None  # a second-stage collective started by a continuation

    def then(self, continuation: Callable[[], Any]) -> "Pending":
        """Run `continuation` when this completes (on the backend's thread). If it starts another
        collective and returns its `Pending`, waiting on this waits for that too.

        A continuation that issues collectives must issue them in the same order on every rank
        (e.g. on a link only continuations use, in a fixed order): backend threads finish out of order.
        """
        base = self._future if self._future is not None else self._work.get_future()

        def run(done: torch.futures.Future) -> None:
            done.wait()  # re-raises the collective's error into the chained future
            after = continuation()
            if isinstance(after, Pending):
                self._after = after

        self._future = base.then(run)
        return self

    def wait(self) -> None:
        started = time.perf_counter()
        try:
            if self._work is not None:
                self._work.wait()
            if self._future is not None:
                self._future.wait()
            if self._after is not None:
                self._after.wait()
        except PeerFailureError:
            raise
        except Exception as exc:  # gloo/NCCL raise plain RuntimeError subclasses
            raise PeerFailureError(
                f"commsched: {self._what} failed. A peer process probably died, hung past the "
                f"process-group timeout, or the network link broke. Original error: {exc}"
            ) from exc
        finally:
            if self._clock is not None:
                self._clock.seconds += time.perf_counter() - started

    def is_completed(self) -> bool:
        done = self._future.done() if self._future is not None else self._work.is_completed()
        return done and (self._after is None or self._after.is_completed())


class InOrder:
    """Collectives that go one after another: each is launched, on the backend's thread, the moment
    the one before it completed. On a saturated link a collective launched together with others
    shares the bandwidth with them; in a chain the first one needed finishes first (DeAR's
    all-gathers, in the order the next forward needs them). The launch order is the same on every
    rank; `wait(i)` waits for the i-th one, and a failure anywhere reaches every waiter."""

    def __init__(self, launches: list[Callable[[], Pending]], timeout_s: float) -> None:
        self._launches = launches
        self._timeout_s = timeout_s
        self._pending: list[Optional[Pending]] = [None] * len(launches)
        self._launched = [threading.Event() for _ in launches]
        self._error: Optional[BaseException] = None
        if launches:
            self._launch(0)

    def _launch(self, i: int) -> None:
        try:
            pending = self._launches[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            self._fail(i, exc)
            return
        self._pending[i] = pending
        self._launched[i].set()
        if i + 1 < len(self._launches):
            pending.then(partial(self._launch, i + 1))  # not run if it failed: its own waiter gets the error

    def _fail(self, i: int, error: BaseException) -> None:
        self._error = error
        for event in self._launched[i:]:
            event.set()

    def done(self, i: int) -> bool:
        """The i-th collective was launched and has completed (waiting on it would not block)."""
        pending = self._pending[i]
        return self._launched[i].is_set() and pending is not None and pending.is_completed()

    def wait(self, i: int) -> None:
        if not self._launched[i].wait(self._timeout_s):
            raise PeerFailureError(f"commsched: collective {i} of a chain was not launched within {self._timeout_s:.0f} s; "
                                   "a peer probably died or hung")
        pending = self._pending[i]
        if pending is None:
            raise PeerFailureError(f"commsched: a collective of a chain could not be launched: {self._error}") from self._error
        pending.wait()


class Link:
    """Issues asynchronous collectives on one process group (None = the default group)."""

    def __init__(self, name: str, group: Optional[dist.ProcessGroup] = None,
                 trace: Optional[list[CollectiveRecord]] = None) -> None:
        """`trace`: a list to append a record of every collective to (links may share one)."""
        self.name = name
        self.group = group
        self.trace = trace
        self.clock = WaitClock()
        self.spans: Optional[list[Span]] = None  # set by the profiler: launch-to-completion of each collective
        self.timeout_s = 1800.0  # the process group's; Links sets it
        self._lock = threading.Lock()  # continuations may issue collectives from backend threads

    @property
    def lane(self) -> str:
        return f"link: {self.name}"

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group))

    @property
    def device(self) -> torch.device:
        """Where every tensor this link's collectives touch must live."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        """A small control tensor (mask, decision, hash) on this link's device."""
        return torch.as_tensor(values, dtype=dtype, device=self.device)

    def _issue(self, op: str, tag: str, tensor: torch.Tensor, launch: Callable[[], dist.Work]) -> Pending:
        what = f"{op} of {tag} ({tensor.numel()} x {tensor.dtype}) on link '{self.name}'"
        with self._lock:
            if self.trace is not None:
                self.trace.append(CollectiveRecord(self.name, op, tag, tensor.numel(), str(tensor.dtype)))
            work = launch()
        if self.spans is not None:
            spans, lane, name, start = self.spans, self.lane, f"{op} {tag}", time.perf_counter()
            work.get_future().add_done_callback(lambda _: spans.append(Span(lane, name, start, time.perf_counter())))
        return Pending(work, what, clock=self.clock)

    def all_reduce(self, tensor: torch.Tensor, tag: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Pending:
        return self._issue("all_reduce", tag, tensor, partial(dist.all_reduce, tensor, op=op, group=self.group, async_op=True))

    @property
    def native_reduce_scatter(self) -> bool:
        """False for gloo: its reduce-scatter costs a whole all-reduce; `exchange` does both halves instead."""
        return self.backend != "gloo"

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, tag: str,
                       scratch: Optional[torch.Tensor] = None) -> Pending:
        """Sum `full` over ranks and leave this rank's slice in `shard`.

        `scratch` (at least (P-1)/P of `full`) receives the other ranks' slices when the backend has no
        efficient reduce-scatter (`exchange`); the local sum then runs as a continuation on completion."""
        if self.native_reduce_scatter:
            launch = partial(_reduce_scatter_single, shard, full, group=self.group, async_op=True)
            return self._issue("reduce_scatter", tag, full, launch)
        if scratch is None:
            raise ValueError("commsched: reduce_scatter over gloo needs a scratch tensor of (P-1)/P of `full`")
        reduce: list[Callable[[], None]] = []

        def launch() -> exchange.WorkSet:
            work, local_sum = exchange.reduce_scatter(self.group, shard, full, scratch)
            reduce.append(local_sum)
            return work

        return self._issue("reduce_scatter", tag, full, launch).then(lambda: reduce[0]())

    def in_order(self, launches: list[Callable[[], Pending]]) -> InOrder:
        return InOrder(launches, self.timeout_s)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, tag: str) -> Pending:
        if self.native_reduce_scatter:
            launch = partial(_all_gather_single, full, shard, group=self.group, async_op=True)
        else:  # gloo's all-gather copies more than the point-to-point exchange (see `exchange`)
            launch = partial(exchange.all_gather, self.group, full, shard)
        return self._issue("all_gather", tag, full, launch)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: str) -> Pending:
        return self._issue("broadcast", tag, tensor, partial(dist.broadcast, tensor, src=src, group=self.group, async_op=True))

    def all_gather_int(self, value: int, tag: str) -> list[int]:
        """Blocking all-gather of one int64 per rank (plan hashes, decisions)."""
        mine = self.tensor([value], torch.int64)
        everyone = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self.all_gather(everyone, mine, tag).wait()
        return everyone.tolist()

    def broadcast_object(self, value: Any, src: int, tag: str) -> Any:
        """Blocking broadcast of a picklable object (plans, decisions); every rank returns src's."""
        holder = [value if self.rank == src else None]
        if self.trace is not None:
            self.trace.append(CollectiveRecord(self.name, "broadcast_object", tag, 1, "object"))
        try:
            dist.broadcast_object_list(holder, src=src, group=self.group, device=self.device)
        except Exception as exc:
            raise PeerFailureError(f"commsched: broadcast of {tag} on link '{self.name}' failed: {exc}") from exc
        return holder[0]

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int, tag: str) -> None:
        """Blocking broadcast of many tensors from `src` as one message of their bytes, whatever their dtypes."""
        if not tensors:
            return
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
            self.broadcast(flat, src, tag).wait()
            offset = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                # clone: an aligned, contiguous copy that can be reinterpreted as t's dtype (t may be
                # channels_last or otherwise strided, so it is filled by copy_, not by a view)
                t.copy_(flat[offset : offset + n].clone().view(t.dtype).view(t.shape))
                offset += n


@contextmanager
def _interface(backend: str, ifname: Optional[str]) -> Iterator[None]:
    """The backends read the interface from the environment when a group is created."""
    if ifname is None:
        yield
        return
    key = IFNAME_ENV[backend]
    previous = os.environ.get(key)
    os.environ[key] = ifname
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


class Links:
    """A run's links by name: `control` (the default group: setup checks, buffer broadcasts, plan
    decisions) and one new group per spec, created on every rank in the order given."""

    def __init__(self, specs: list[LinkSpec], timeout: Optional[timedelta], trace: Optional[list[CollectiveRecord]]) -> None:
        self.control = Link("control", None, trace)
        self._links: dict[str, Link] = {}
        timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
        for spec in specs:
            backend = spec.backend or str(dist.get_backend())
            with _interface(backend, spec.ifname):
                group = dist.new_group(backend=backend, timeout=timeout)
            log.debug(f"commsched: link '{spec.name}': {backend}" + (f" on {spec.ifname}" if spec.ifname else ""))
            self._links[spec.name] = Link(spec.name, group, trace)
        for link in self:
            link.timeout_s = timeout_s

    def __getitem__(self, name: str) -> Link:
        return self._links[name]

    def __iter__(self) -> Iterator[Link]:
        return iter([*self._links.values(), self.control])

    @property
    def exposed_seconds(self) -> float:
        """Time the training loop waited on any link."""
        return sum(link.clock.seconds for link in self)

    def destroy(self) -> None:
        for link in self._links.values():
            if link.group is not None:
                exchange.release(link.group)
                dist.destroy_process_group(link.group)
                link.group = None
        self._links.clear()
