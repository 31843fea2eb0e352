"""Named process groups ("links") and the collectives a schedule issues on them.

Every collective goes through a `Link`, the one place that (a) picks the collective the installed
torch offers, (b) keeps the tensors it touches on the link's device (the rank's own CUDA device
for NCCL, fixed when the link is made; the CPU for gloo), (c) issues collectives in the order
they were requested (`commsched.comm.works`: chains, staged inputs and second stages -- requested
with `after=` their first stage -- wait in the link's queue, never out of order), (d) turns a failed or timed-out
collective into a `PeerFailureError` that says which one and why, (e) records the sequence of collectives a rank
issued, which tests compare across ranks, and counts the bytes this rank sends, and (f) times
what the training loop waited for. `Links` creates a run's links on every rank in the same order:
whole-world links, sub-group links (one group per node, one per local rank, each rank holding its
own) and several streams of one link.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from commsched.comm import point_to_point
from commsched.comm.device_time import SpanRecorder, synchronize
from commsched.comm.works import After, Issuer, Pending, WaitClock
from commsched.errors import PeerFailureError

# torch 2.10+ renamed the tensor-in/tensor-out collectives; keep working on torch >= 2.3.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

log = logging.getLogger(__name__)

IFNAME_ENV = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
KNOWN_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
KNOWN_LINKS = ("primary", "secondary", "intra", "inter")
"""What a schedule's `links_used` may name: the whole world on the primary and on the secondary network,
and the sub-groups of the primary (the ranks of one node; the ranks of one local rank across nodes)."""
"""What a schedule's `step_collectives` may name: the collectives a `Link` issues and the profiler times."""

__all__ = [
    "CollectiveRecord",
    "InOrder",
    "KNOWN_COLLECTIVES",
    "KNOWN_LINKS",
    "Link",
    "LinkSpec",
    "Links",
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


@dataclass(frozen=True)
class LinkSpec:
    """How to make one link: its name, backend (None: the default group's), network interface,
    the groups of global ranks it connects (None: all ranks; else a partition, one group per part,
    e.g. one per node), and how many parallel groups (streams) of it to make."""

    name: str
    backend: Optional[str] = None
    ifname: Optional[str] = None
    groups: Optional[tuple[tuple[int, ...], ...]] = None
    streams: int = 1


def node_groups(world_size: int, per_node: int) -> tuple[tuple[int, ...], ...]:
    """The ranks of each node (Lightning numbers a node's ranks consecutively)."""
    return tuple(tuple(range(n * per_node, (n + 1) * per_node)) for n in range(world_size // per_node))


def local_rank_groups(world_size: int, per_node: int) -> tuple[tuple[int, ...], ...]:
    """The ranks with the same local rank on every node (the inter-node groups of a hierarchical exchange)."""
    return tuple(tuple(range(local, world_size, per_node)) for local in range(per_node))


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
        """Blocking broadcast of many tensors from `src` as one message of their bytes, whatever their dtypes."""
        if not tensors:
            return
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8).to(self.device) for t in tensors])
            self.broadcast(flat, src, tag).wait()
            offset = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                # clone: an aligned, contiguous copy that can be reinterpreted as t's dtype (t may be
                # channels_last or otherwise strided, so it is filled by copy_, not by a view)
                t.copy_(flat[offset : offset + n].clone().view(t.dtype).view(t.shape))
                offset += n

    def stop(self) -> None:
        self._issuer.stop()


@contextmanager
def _interface(backend: str, ifname: Optional[str]) -> Iterator[None]:
    """The backends read the interface from the environment when a group's connections are made."""
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
    decisions) and the groups of each spec, created on every rank in the order given. A spec with
    S streams makes links `name`, `name.1`, ..., `name.{S-1}` (`streams(name)` lists them).

    More streams are made when a schedule first asks for them (`streams(name, count)`), and the ones
    no longer used are released (`release_streams`): a gloo group keeps its connections and a thread
    that wakes every few milliseconds, so a run that searched 16 streams and settled on one must not
    keep the other 15 of each link. Both are collective: every rank calls them at the same iteration
    boundary (the stream search's decisions are broadcast)."""

    def __init__(
        self,
        specs: list[LinkSpec],
        timeout: Optional[timedelta],
        trace: Optional[list[CollectiveRecord]],
        device: Optional[torch.device] = None,
        wire_dtype: torch.dtype = torch.float32,
    ) -> None:
        """`device`: the rank's own accelerator (the model's device), where NCCL links keep their tensors;
        `wire_dtype`: what gradients travel as on every link (`comm_dtype`)."""
        self.wire_dtype = wire_dtype
        self._timeout = timeout
        self._timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
        self._trace = trace
        self._device = device
        self.control = Link("control", None, trace, device, self._timeout_s)
        self.control.wire_dtype = wire_dtype
        self._specs = {spec.name: spec for spec in specs}
        self._links: dict[str, Link] = {}
        self._streams: dict[str, list[Link]] = {}
        self._made: list[Callable[[Link], None]] = []
        self.retired: list[Link] = []
        """Links released during the run (stopped, groups destroyed): their bytes and waits still count."""
        self._sent_when_destroyed: Optional[dict[str, float]] = None
        for spec in specs:
            self._streams[spec.name] = []
            self._grow(spec, spec.streams)

    def _grow(self, spec: LinkSpec, count: int) -> None:
        backend = spec.backend or str(dist.get_backend())
        for stream in range(len(self._streams[spec.name]), count):
            name = spec.name if stream == 0 else f"{spec.name}.{stream}"
            with _interface(backend, spec.ifname):
                group = self._new_group(spec, backend, self._timeout, self._device)
                link = Link(name, group, self._trace, self._device, self._timeout_s)
                link.wire_dtype = self.wire_dtype
                if backend == "nccl":  # NCCL makes its communicator at the first collective: while the interface is set
                    dist.all_reduce(torch.zeros(1, device=link.device), group=group)
            log.debug(
                f"commsched: link '{name}': {backend}"
                + (f" on {spec.ifname}" if spec.ifname else "")
                + (f", groups {spec.groups}" if spec.groups else "")
            )
            self._links[name] = link
            self._streams[spec.name].append(link)
            for configure in self._made:
                configure(link)

    @staticmethod
    def _new_group(spec: LinkSpec, backend: str, timeout: Optional[timedelta], device: Optional[torch.device]) -> Any:
        if spec.groups is None:
            return dist.new_group(backend=backend, timeout=timeout)
        mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in spec.groups], timeout=timeout, backend=backend)
        return mine

    def __getitem__(self, name: str) -> Link:
        if name not in self._links:
            raise KeyError(f"commsched: no link '{name}'; this run's links: {', '.join(self._links)} (and 'control')")
        return self._links[name]

    def __contains__(self, name: str) -> bool:
        return name in self._links

    def __iter__(self) -> Iterator[Link]:
        return iter([*self._links.values(), self.control])

    def streams(self, name: str, count: Optional[int] = None) -> list[Link]:
        """The parallel groups of one link spec, in stream order (one for a spec without streams);
        with `count`, at least that many, the missing ones made now (collective: see the class)."""
        if count is not None and count > len(self._streams[name]):
            self._grow(self._specs[name], count)
        return list(self._streams[name])

    def release_streams(self, keep: dict[str, int]) -> int:
        """Destroy each spec's streams from `keep[name]` on (a name not given keeps 1; 0 releases the
        link whole until a schedule asks for it again); collective, see the class. How many groups
        went. Nothing may be in flight on them (they are released between iterations, once unused)."""
        released = 0
        for name, streams in self._streams.items():
            kept = max(0, keep.get(name, 1))
            for link in streams[kept:]:
                link.stop()
                self._destroy_group(link)
                del self._links[link.name]
                self.retired.append(link)
                released += 1
            del streams[kept:]
        if released:
            log.debug(f"commsched: released {released} idle stream groups (kept {keep})")
        return released

    def when_made(self, configure: Callable[[Link], None]) -> None:
        """Apply `configure` to every link, now and as more are made (the profiler's recorders)."""
        self._made.append(configure)
        for link in [*self._links.values(), self.control]:
            configure(link)

    @staticmethod
    def _destroy_group(link: Link) -> None:
        if link.group is not None:
            point_to_point.release(link.group)
            dist.destroy_process_group(link.group)
            link.group = None

    @property
    def exposed_seconds(self) -> float:
        """Time the training loop waited on any link."""
        return sum(link.clock.seconds for link in [*self, *self.retired])

    @property
    def wire_bytes(self) -> dict[str, float]:
        """Bytes this rank has sent, per link (each stream is a link); after `destroy`, the final figures."""
        if self._sent_when_destroyed is not None:
            return dict(self._sent_when_destroyed)
        sent: dict[str, float] = {}
        for link in [*self.retired, *self]:  # a stream released and made again sums both
            sent[link.name] = sent.get(link.name, 0.0) + link.wire_bytes
        return sent

    def stop_issuers(self) -> None:
        """After a failure: end the issuer threads (a request behind a failed collective fails at once;
        one behind a hung one is left after a few seconds), keeping the groups, which may be broken.
        A thread left inside the backend at interpreter exit can abort the process."""
        for link in self:
            link.stop()

    def destroy(self) -> None:
        self._sent_when_destroyed = self.wire_bytes
        for link in self:
            link.stop()
        for link in self._links.values():
            self._destroy_group(link)
        self._links.clear()
        self._streams.clear()
