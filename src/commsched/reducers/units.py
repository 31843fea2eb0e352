"""Units: the fixed-size buckets sliced into pieces of at most U bytes, each sent on its own stream.

The bucket plan stays the single source of order: units are numbered in bucket (ready) order, and
unit i goes on stream i mod S, the same on every rank. AIACC hands a unit to "the first free
thread", which is decided per rank and would pair different collectives on the same group
(ranks would disagree on which collective a group carries next, and hang or mix them). A unit is a contiguous
slice of its bucket's flat buffer, so a large tensor is split across units, and its length is a multiple of the
world size (a bucket is padded to one), so each unit can be reduce-scattered on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from commsched.comm.buckets import BucketPlan


@dataclass(frozen=True)
class Striping:
    """One configuration of the multi-stream exchange: what the search chooses among."""

    streams: int = 1
    """Process groups (streams) carrying units at once."""
    unit_mb: float = 4.0
    """Largest unit (MB); ignored with one stream, where each bucket is one unit, as without streams."""
    hierarchical: bool = False
    """Each unit reduced node first (intra-node reduce-scatter, inter-node all-reduce, intra-node
    all-gather; wfbp on several nodes)."""

    def describe(self) -> str:
        if self.streams == 1:
            return "1 stream" + (", two-level" if self.hierarchical else "")
        return f"{self.streams} streams, {self.unit_mb:g} MB units" + (", two-level" if self.hierarchical else "")

    def to_json(self) -> dict[str, Any]:
        return {"streams": self.streams, "unit_mb": self.unit_mb, "hierarchical": self.hierarchical}

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> "Striping":
        return cls(int(saved["streams"]), float(saved["unit_mb"]), bool(saved["hierarchical"]))


@dataclass(frozen=True)
class Unit:
    """Elements `start .. start + numel` of bucket `bucket`'s buffer, sent on stream `stream`."""

    bucket: int
    start: int
    numel: int
    stream: int
    tag: str = field(init=False, compare=False, repr=False)
    """The collective's tag in traces: the bucket's own for its first unit (all of it, with one stream);
    made once, as every collective of the unit carries it."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "tag", f"bucket{self.bucket}" if self.start == 0 else f"bucket{self.bucket}@{self.start}"
        )


def plan_units(plan: BucketPlan, striping: Striping) -> list[list[Unit]]:
    """Per bucket, its units in order. One stream: one unit per bucket (the exchange without streams)."""
    world = plan.world_size
    units: list[list[Unit]] = []
    counter = 0
    for bucket in plan.buckets:
        total = bucket.buffer.numel()
        if striping.streams == 1:
            units.append([Unit(bucket.index, 0, total, 0)])
            continue
        per_unit = int(striping.unit_mb * 2**20) // bucket.buffer.element_size()
        per_unit = max(world, per_unit // world * world)
        mine = []
        for start in range(0, total, per_unit):
            mine.append(Unit(bucket.index, start, min(per_unit, total - start), counter % striping.streams))
            counter += 1
        units.append(mine)
    return units
