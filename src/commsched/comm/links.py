"""A link: one process group and the collectives a schedule issues on it.

Every collective goes through a `Link`, the one place that (a) picks the collective the installed
torch offers, (b) keeps the tensors it touches on the link's device (the rank's own CUDA device
for NCCL, fixed when the link is made; the CPU for gloo), (c) issues collectives in the order
they were requested (`Issuer`, below), (d) turns a failed or timed-out collective into a
`PeerFailureError` that says which one and why, (e) records the sequence of collectives a rank
issued, which tests compare across ranks, and counts the bytes this rank sends, and (f) times what
the training loop waited for. A run's links are made by `commsched.comm.link_groups.Links`.

**In-flight collectives (`Pending`) and their order (`Issuer`).** The rule that keeps every rank in
lock-step: on each link, collectives are issued in the order they were *requested*, and only the
training thread requests, in program order (the same on every rank). A request may have to wait
before it can be issued: for another collective to complete (`after`: the one before it in a chain,
as DeAR's all-gathers in the order the next forward needs them; or the first stage of a two-stage
exchange, whose continuations -- a local sum, a decompression -- then have run too), or for its
input to land in host memory (`ready`: a gloo link staging a CUDA bucket). Such a request waits in
the link's queue, with everything requested after it on that link, while the training thread goes
on; the link's issuer thread issues them in order. A request with nothing to wait for on an idle
link is issued at once by the requesting thread. No collective is ever issued from a backend's
completion thread: a second stage is requested by the training thread with `after=` its first stage,
so it never interleaves with the training thread's collectives on its group, and a chain of any
length is a loop, not a recursion.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from commsched.comm import peers, point_to_point
from commsched.comm.device_time import SpanRecorder, synchronize
from commsched.errors import PeerFailureError

# torch 2.10+ renamed the tensor-in/tensor-out collectives; keep working on torch >= 2.3.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

log = logging.getLogger(__name__)

KNOWN_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
"""What a schedule's `step_collectives` may name: the collectives a `Link` issues and the profiler times."""

__all__ = [
    "CollectiveRecord",
    "InOrder",
    "KNOWN_COLLECTIVES",
    "Issuer",
    "Link",
    "Pending",
    "WaitClock",
]


WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""`comm_dtype`'s names as torch dtypes."""


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank's issuer sent it to the backend (not as it was requested): enough to
    prove every rank sent the same sequence on each link."""

    link: str
    op: str
    tag: str
    numel: int
    dtype: str


Launch = Callable[[], dist.Work]
After = Union[None, "Pending", Sequence["Pending"]]
"""What a request waits for before it is issued: nothing, one collective, or several."""


class WaitClock:
    """Seconds the training loop spent blocked on a link: communication that did not overlap compute."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


class Pending:
    """A requested collective: issued now or later by its link, then in flight, then complete.
    `wait()` re-raises the collective's failures as `PeerFailureError`, and a local error (in the
    launch or a continuation: a shape error, an assertion, out of memory) as itself, with a note
    saying where; `then(f)` runs local work (a sum, a copy) on the backend's thread the moment the
    collective completes."""

    __slots__ = (
        "_work",
        "_future",
        "_what",
        "_clock",
        "_issued",
        "_error",
        "_timeout_s",
        "_later",
        "_sync",
        "_lock",
        "_local_error",
    )

    def __init__(
        self,
        what: str,
        clock: Optional[WaitClock] = None,
        timeout_s: float = 1800.0,
        sync: Optional[Callable[[], None]] = None,
    ) -> None:
        self._work: Optional[dist.Work] = None
        self._future: Optional[torch.futures.Future] = None  # the last continuation, if any
        self._what = what
        self._clock = clock
        self._issued = threading.Event()
        self._error: Optional[BaseException] = None
        self._timeout_s = timeout_s
        self._later: list[Callable[[], Any]] = []  # continuations asked for before the collective was issued
        self._sync = sync  # on CUDA while measuring: the host waits for the stream, so the clock sees completion
        # `issued` (on the issuer thread) and `then` (on the training thread) may run at the same time:
        # without it a continuation asked for between the chaining loop and `_issued.set()` is lost
        self._lock = threading.Lock()
        self._local_error: Optional[BaseException] = None  # raised by this process's own work, not by a peer

    # ------------------------------------------------------------- the link's side
    def issued(self, work: dist.Work) -> None:
        with self._lock:
            self._work = work
            for continuation in self._later:
                self._chain(continuation)
            self._later.clear()
            self._issued.set()

    def failed(self, error: BaseException, local: bool = False) -> None:
        """`local`: the launch itself raised, and not for a reason of the backend's (see `is_local`)."""
        with self._lock:
            self._error = error
            if local:
                self._local_error = error
            self._issued.set()

    # ------------------------------------------------------------- the user's side
    def then(self, continuation: Callable[[], Any]) -> "Pending":
        """Run `continuation()` when this completes (on the backend's thread); local work only."""
        with self._lock:
            if self._issued.is_set():
                self._chain(continuation)
            else:
                self._later.append(continuation)
        return self

    def _chain(self, continuation: Callable[[], Any]) -> None:
        if self._work is None:
            return
        base = self._future if self._future is not None else self._work.get_future()

        def run(done: torch.futures.Future) -> None:
            done.wait()  # re-raises the collective's error into the chained future
            try:
                continuation()
            except BaseException as exc:
                self._local_error = exc
                raise

        self._future = base.then(run)

    def wait(self, exposed: bool = True) -> None:
        """`exposed`: the training loop is the one waiting, and its wait counts on the link's clock; the
        issuer thread waiting for a predecessor passes False (the loop went on computing meanwhile)."""
        started = time.perf_counter()
        try:
            if not self._issued.wait(self._timeout_s):
                raise PeerFailureError(
                    f"commsched: {self._what} was not issued within {self._timeout_s:.0f} s: the "
                    f"collective before it on its link never completed; {_who_failed('died or hung')}"
                )
            if self._error is not None:
                raise self._error
            assert self._work is not None
            self._work.wait()
            if self._future is not None:
                self._future.wait()
            if self._sync is not None:
                self._sync()
        except PeerFailureError:
            raise
        except Exception as exc:  # gloo/NCCL raise plain RuntimeError subclasses
            local = self._local_error
            if local is not None:
                note = f"commsched: raised by this process's own work on {self._what} (no peer failed)"
                if note not in getattr(local, "__notes__", ()):
                    local.add_note(note)
                raise local from None
            raise PeerFailureError(
                f"commsched: {self._what} failed: "
                f"{_who_failed('died, hung past the process-group timeout, or the network link broke')}. "
                f"Original error: {exc}"
            ) from exc
        finally:
            if self._clock is not None and exposed:
                self._clock.seconds += time.perf_counter() - started

    def failure(self) -> Optional[BaseException]:
        """A completed request's error, if it failed (never waits, syncs or counts as waiting)."""
        if self._error is not None:
            return self._error
        done = self._future if self._future is not None else self._work.get_future() if self._work is not None else None
        if done is None or not done.done():
            return None
        try:
            done.value()
        except Exception as exc:  # noqa: BLE001 - the collective's or a continuation's error
            return exc
        return None

    def is_completed(self) -> bool:
        if not self._issued.is_set():
            return False
        if self._error is not None:
            return True
        assert self._work is not None
        return self._future.done() if self._future is not None else self._work.is_completed()


PACKED_ON_DEVICE_UP_TO = 64 * 2**20
"""Bytes of a many-tensor broadcast packed on the tensors' own device (`Link.broadcast_tensors`)."""


def byte_layout(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Where each tensor's bytes start in a packed message, and its total length last: every start
    aligned to 16 bytes (the widest element, complex128), so each piece can be read back as its own
    dtype without a copy."""
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += -(-t.numel() * t.element_size() // 16) * 16
    return [*offsets, offset]


def pack_bytes(tensors: Sequence[torch.Tensor], layout: list[int], device: torch.device) -> torch.Tensor:
    """The tensors' bytes in one uint8 tensor on `device` (one concatenation; padding zeros)."""
    pad = torch.zeros(16, dtype=torch.uint8, device=device)
    pieces: list[torch.Tensor] = []
    for t, start, end in zip(tensors, layout, layout[1:]):
        raw = t.detach().resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8).to(device)
        pieces += [raw, pad[: end - start - raw.numel()]]
    return torch.cat(pieces)


def unpack_bytes(message: torch.Tensor, tensors: Sequence[torch.Tensor], layout: list[int]) -> None:
    """Copy each tensor's piece of `message` (on the tensors' device) into it, whatever its strides."""
    for t, start in zip(tensors, layout):
        piece = message[start : start + t.numel() * t.element_size()]
        t.copy_(piece.view(t.dtype).view(t.shape))


def _who_failed(otherwise: str) -> str:
    """The rank known gone ('rank 1 (process 4242) has exited'), else what probably happened."""
    gone = peers.describe_gone()
    return f"{gone} (a peer process died)" if gone else f"a peer process probably {otherwise}"


def is_local(error: BaseException) -> bool:
    """An error of this process's own making: not the backend's (`torch.distributed.DistError`, or the
    plain RuntimeError gloo and NCCL raise when a connection breaks) nor a failed predecessor."""
    if isinstance(error, (PeerFailureError, dist.DistError)):
        return False
    return isinstance(error, (ValueError, TypeError, AssertionError, IndexError, KeyError, torch.OutOfMemoryError))


@dataclass
class _Request:
    pending: Pending
    launch: Launch
    after: tuple[Pending, ...] = ()
    ready: Any = None  # a torch.cuda.Event the inputs wait for


class Issuer:
    """One link's order of collectives (see the module's docstring)."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self._name = name
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # held while deciding and while issuing at once
        self._wakeup = threading.Condition(self._lock)
        self._queue: collections.deque[_Request] = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def request(
        self, pending: Pending, launch: Launch, after: After = None, ready: Any = None, offload: bool = False
    ) -> Pending:
        """`offload`: always issue from the issuer thread (a launch that costs the caller real work, such
        as posting gloo's point-to-point sends, which copy into the socket on the calling thread)."""
        waits = () if after is None else (after,) if isinstance(after, Pending) else tuple(after)
        with self._lock:
            if not self._queue and not offload and ready is None and all(w.is_completed() for w in waits):
                self._issue_after(_Request(pending, launch, waits))
                return pending
            self._enqueue(_Request(pending, launch, waits, ready))
        return pending

    def blocking(self, call: Callable[[], Any]) -> Any:
        """Run a blocking collective in this link's order: once everything requested before it has been
        issued, with nothing issued while it runs."""
        assert threading.current_thread() is not self._thread, (
            "a blocking collective from the issuer thread waits for itself"
        )
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            while self._queue:
                if not self._wakeup.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise PeerFailureError(
                        f"commsched: a blocking collective on link '{self._name}' waited {self._timeout_s:.0f} s "
                        f"for the collectives requested before it; {_who_failed('died or hung')}"
                    )
            return call()

    def _enqueue(self, request: _Request) -> None:
        self._queue.append(request)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"commsched-issue-{self._name}", daemon=True)
            self._thread.start()
        self._wakeup.notify_all()

    def _issue_after(self, request: _Request) -> None:
        """Issue `request`, whose predecessors are complete; one that failed fails it instead (a second
        stage never goes out after its first stage failed), as on the queued path."""
        failed = next((error for error in map(Pending.failure, request.after) if error is not None), None)
        if failed is not None:
            request.pending.failed(failed)  # its `wait()` names it, as it names a backend's error
        else:
            self._issue(request)

    @staticmethod
    def _issue(request: _Request) -> None:
        try:
            work = request.launch()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            request.pending.failed(exc, local=is_local(exc))
            return
        request.pending.issued(work)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._wakeup.wait()
                if not self._queue:
                    return
                request = self._queue[0]
            try:
                self._wait_for(request)
            except BaseException as exc:  # noqa: BLE001 - a failed or hung predecessor
                request.pending.failed(exc)
            else:
                with self._lock:
                    self._issue(request)
            with self._lock:
                self._queue.popleft()
                self._wakeup.notify_all()  # a `blocking` call may be waiting for the queue to drain

    def _wait_for(self, request: _Request) -> None:
        for predecessor in request.after:
            predecessor.wait(exposed=False)
        if request.ready is not None:
            request.ready.synchronize()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the issuer thread once the queue is empty (before the group is destroyed, at exit)."""
        with self._lock:
            self._stopping = True
            self._wakeup.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)


class InOrder:
    """Collectives that go one after another: each is issued once the one before it completed, in
    the same order on every rank (requested now, issued by the link). On a saturated link a
    collective issued together with others shares the bandwidth with them; in a chain the first one
    needed finishes first (DeAR's all-gathers, in the order the next forward needs them)."""

    def __init__(self, launches: Sequence[Callable[[Optional[Pending]], Pending]]) -> None:
        self._pending: list[Pending] = []
        previous: Optional[Pending] = None
        for launch in launches:
            previous = launch(previous)
            self._pending.append(previous)

    def done(self, i: int) -> bool:
        """The i-th collective has completed (waiting on it would not block)."""
        return self._pending[i].is_completed()

    def wait(self, i: int) -> None:
        self._pending[i].wait()


class Link:
    """Issues asynchronous collectives on one process group (None = the default group)."""

    def __init__(
        self,
        name: str,
        group: Optional[dist.ProcessGroup] = None,
        trace: Optional[list[CollectiveRecord]] = None,
        device: Optional[torch.device] = None,
        timeout_s: float = 1800.0,
    ) -> None:
        """`trace`: a list to append a record of every collective to (links may share one); `device`:
        the rank's own accelerator for NCCL links (default: the current CUDA device, read here)."""
        self.name = name
        self.group = group
        self.trace = trace
        self.clock = WaitClock()
        self.timeout_s = timeout_s
        self.wire_dtype = torch.float32
        """What gradients travel as on this link (`comm_dtype`; control messages keep their own dtypes)."""
        self.wire_bytes = 0.0
        """Bytes this rank has sent on this link (ring counts: an all-reduce sends 2(P-1)/P of the tensor)."""
        self.recorder: Optional[SpanRecorder] = None  # set by the profiler: launch-to-completion of each collective
        self.measuring = False  # set by the profiler: on CUDA, waits end with a synchronize (the clock sees completion)
        self.backend = str(dist.get_backend(group))
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.backend == "nccl":
            self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._issuer = Issuer(name, timeout_s)

    def wire_for(self, dtype: torch.dtype) -> torch.dtype:
        """What a tensor of gradients in `dtype` travels as on this link: fp32 in the wire dtype, others as they are."""
        return self.wire_dtype if dtype == torch.float32 else dtype

    @property
    def lane(self) -> str:
        return f"link: {self.name}"

    def tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        """A small control tensor (mask, decision, hash) on this link's device."""
        return torch.as_tensor(values, dtype=dtype, device=self.device)

    def synchronize(self) -> None:
        """The host waits for everything enqueued on this link's device (measuring only)."""
        synchronize(self.device)

    def _request(
        self,
        op: str,
        tag: str,
        tensor: torch.Tensor,
        launch: Callable[[], dist.Work],
        on_wire: float,
        after: After = None,
        ready: Any = None,
        offload: bool = False,
    ) -> Pending:
        what = f"{op} of {tag} ({tensor.numel()} x {tensor.dtype}) on link '{self.name}'"
        sync = partial(synchronize, self.device) if self.measuring and self.device.type == "cuda" else None
        pending = Pending(what, self.clock, self.timeout_s, sync)
        recorder = self.recorder
        timed = launch if recorder is None else partial(recorder.around, self.lane, f"{op} {tag}", launch)
        return self._issuer.request(
            pending,
            partial(self._launch_and_record, timed, op, tag, tensor, on_wire),
            after=after,
            ready=ready,
            offload=offload,
        )

    def _launch_and_record(
        self, launch: Callable[[], Any], op: str, tag: str, tensor: torch.Tensor, on_wire: float
    ) -> Any:
        """Record a collective once it has gone to the backend, in the order this link's issuer sent it
        (the issuer holds its lock: records of one link never interleave); a launch that raised sent nothing."""
        work = launch()
        self.wire_bytes += on_wire * tensor.numel() * tensor.element_size() * (self.world_size - 1) / self.world_size
        if self.trace is not None:
            self.trace.append(CollectiveRecord(self.name, op, tag, tensor.numel(), str(tensor.dtype)))
        return work

    def all_reduce(
        self,
        tensor: torch.Tensor,
        tag: str,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        after: After = None,
        ready: Any = None,
    ) -> Pending:
        return self._request(
            "all_reduce",
            tag,
            tensor,
            partial(dist.all_reduce, tensor, op=op, group=self.group, async_op=True),
            2.0,
            after,
            ready,
        )

    @property
    def native_reduce_scatter(self) -> bool:
        """False for gloo: its reduce-scatter costs a whole all-reduce; `point_to_point` does both halves instead."""
        return self.backend != "gloo"

    def reduce_scatter(
        self,
        shard: torch.Tensor,
        full: torch.Tensor,
        tag: str,
        scratch: Optional[torch.Tensor] = None,
        after: After = None,
        ready: Any = None,
    ) -> Pending:
        """Sum `full` over ranks and leave this rank's slice in `shard`.

        `scratch` (at least (P-1)/P of `full`) receives the other ranks' slices when the backend has no
        efficient reduce-scatter (`point_to_point`); the local sum then runs as a continuation on completion."""
        if self.native_reduce_scatter:
            launch = partial(_reduce_scatter_single, shard, full, group=self.group, async_op=True)
            return self._request("reduce_scatter", tag, full, launch, 1.0, after, ready)
        if scratch is None:
            raise ValueError("commsched: reduce_scatter over gloo needs a scratch tensor of (P-1)/P of `full`")
        reduce: list[Callable[[], None]] = []

        def launch() -> point_to_point.WorkSet:
            work, local_sum = point_to_point.reduce_scatter(self.group, shard, full, scratch)
            reduce.append(local_sum)
            return work

        return self._request("reduce_scatter", tag, full, launch, 1.0, after, ready, offload=True).then(
            lambda: reduce[0]()
        )

    def all_gather(
        self, full: torch.Tensor, shard: torch.Tensor, tag: str, after: After = None, ready: Any = None
    ) -> Pending:
        if self.native_reduce_scatter:
            launch = partial(_all_gather_single, full, shard, group=self.group, async_op=True)
        else:  # gloo's all-gather copies more than the point-to-point exchange (see `point_to_point`)
            launch = partial(point_to_point.all_gather, self.group, full, shard)
        return self._request("all_gather", tag, full, launch, 1.0, after, ready, offload=not self.native_reduce_scatter)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: str, after: After = None) -> Pending:
        source = dist.get_global_rank(self.group, src) if self.group is not None else src
        launch = partial(dist.broadcast, tensor, src=source, group=self.group, async_op=True)
        return self._request("broadcast", tag, tensor, launch, 1.0, after)

    def in_order(self, launches: Sequence[Callable[[Optional[Pending]], Pending]]) -> InOrder:
        """`launches[i](after)` requests the i-th collective to be issued after `after` completes."""
        return InOrder(launches)

    def all_gather_int(self, value: int, tag: str) -> list[int]:
        """Blocking all-gather of one int64 per rank (plan hashes, decisions)."""
        mine = self.tensor([value], torch.int64)
        everyone = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self.all_gather(everyone, mine, tag).wait()
        return everyone.tolist()

    def broadcast_object(self, value: Any, src: int, tag: str) -> Any:
        """Blocking broadcast of a picklable object (plans, decisions); every rank returns src's."""
        holder = [value if self.rank == src else None]
        source = dist.get_global_rank(self.group, src) if self.group is not None else src
        send = partial(dist.broadcast_object_list, holder, src=source, group=self.group, device=self.device)
        try:
            self._issuer.blocking(partial(self._launch_and_record, send, "broadcast_object", tag, torch.empty(1), 0.0))
        except Exception as exc:
            raise PeerFailureError(f"commsched: broadcast of {tag} on link '{self.name}' failed: {exc}") from exc
        return holder[0]

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int, tag: str) -> None:
        """Blocking broadcast of many tensors from `src` as one message of their bytes, whatever their
        dtypes (a module's buffers before each forward, as DDP broadcasts them). A message of up to
        `PACKED_ON_DEVICE_UP_TO` bytes is packed and unpacked on the tensors' own device: for a CUDA
        model on a gloo link that is one copy each way, not one blocking copy per tensor; a larger one
        (a whole model's state at setup) is packed on the link's device, needing no second copy of the
        model beside it on the GPU. `src` sends its own tensors and leaves them as they are."""
        if not tensors:
            return
        layout = byte_layout(tensors)
        together = all(t.device == tensors[0].device for t in tensors) and layout[-1] <= PACKED_ON_DEVICE_UP_TO
        home = tensors[0].device if together else self.device
        with torch.no_grad():
            if self.rank == src:
                message = pack_bytes(tensors, layout, home).to(self.device)
            else:
                message = torch.empty(layout[-1], dtype=torch.uint8, device=self.device)
            self.broadcast(message, src, tag).wait()
            if self.rank != src:
                unpack_bytes(message.to(home), tensors, layout)

    def stop(self) -> None:
        self._issuer.stop()
