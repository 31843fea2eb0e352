"""A run's links, made on every rank in the same order: whole-world links, sub-group links (one group
per node, one per local rank, each rank holding its own) and several streams of one link, each on
the network interface its spec names.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from commsched.comm import point_to_point
from commsched.comm.links import CollectiveRecord, Link

log = logging.getLogger(__name__)

__all__ = ["IFNAME_ENV", "KNOWN_LINKS", "LinkSpec", "Links", "local_rank_groups", "node_groups"]

IFNAME_ENV = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
KNOWN_LINKS = ("primary", "secondary", "intra", "inter")
"""What a schedule's `links_used` may name: the whole world on the primary and on the secondary network,
and the sub-groups of the primary (the ranks of one node; the ranks of one local rank across nodes)."""


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
