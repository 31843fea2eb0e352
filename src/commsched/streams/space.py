"""The configurations the stream search chooses among: S streams, U-MB units, flat or two-level."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

from commsched.reducers.units import Striping


@dataclass(frozen=True)
class Space:
    streams: tuple[int, ...]
    units_mb: tuple[float, ...]
    hierarchical: tuple[bool, ...] = (False,)

    @classmethod
    def of(cls, max_streams: int, min_unit_mb: float, max_unit_mb: float, two_level: bool) -> "Space":
        """S = 1..max_streams, units the powers of two from min_unit_mb to max_unit_mb (both kept)."""
        units = [min_unit_mb]
        while units[-1] * 2 <= max_unit_mb * (1 + 1e-9):
            units.append(units[-1] * 2)
        if units[-1] < max_unit_mb:
            units.append(max_unit_mb)
        return cls(tuple(range(1, max_streams + 1)), tuple(units), (False, True) if two_level else (False,))

    def canonical(self, s: Striping) -> Striping:
        """One stream sends each bucket whole: its unit size is no choice (kept at the smallest)."""
        return Striping(1, self.units_mb[0], s.hierarchical) if s.streams == 1 else s

    def all(self) -> list[Striping]:
        seen = dict.fromkeys(
            self.canonical(Striping(s, u, h)) for h in self.hierarchical for s in self.streams for u in self.units_mb
        )
        return list(seen)

    # --------------------------------------------------- a point of the box
    def coordinates(self, s: Striping) -> dict[str, float]:
        """Where `s` lies in the continuous box the Bayesian technique searches."""
        point = {"log2_streams": math.log2(s.streams), "log2_unit_mb": math.log2(s.unit_mb)}
        if len(self.hierarchical) > 1:
            point["two_level"] = 1.0 if s.hierarchical else 0.0
        return point

    def bounds(self) -> dict[str, tuple[float, float]]:
        box = {
            "log2_streams": (0.0, math.log2(self.streams[-1]) if self.streams[-1] > 1 else 1e-9),
            "log2_unit_mb": (math.log2(self.units_mb[0]), math.log2(self.units_mb[-1]) + 1e-9),
        }
        if len(self.hierarchical) > 1:
            box["two_level"] = (0.0, 1.0)
        return box

    def nearest(self, point: dict[str, float]) -> Striping:
        streams = min(self.streams, key=lambda s: abs(math.log2(s) - point["log2_streams"]))
        unit = min(self.units_mb, key=lambda u: abs(math.log2(u) - point["log2_unit_mb"]))
        hierarchical = point.get("two_level", 0.0) >= 0.5 and True in self.hierarchical
        return self.canonical(Striping(streams, unit, hierarchical))

    # --------------------------------------------------- moves
    def neighbour(self, s: Striping, rng: random.Random) -> Striping:
        """A small random move: streams x2, /2, +1 or -1; the unit x2 or /2; flat <-> two-level."""
        streams, unit, hierarchical = s.streams, s.unit_mb, s.hierarchical
        move = rng.randrange(3 if len(self.hierarchical) > 1 else 2)
        if move == 0:
            streams = rng.choice([streams * 2, streams // 2, streams + 1, streams - 1])
            streams = min(self.streams[-1], max(1, streams))
        elif move == 1:
            i = self.units_mb.index(unit) if unit in self.units_mb else 0
            unit = self.units_mb[min(len(self.units_mb) - 1, max(0, i + rng.choice([-1, 1])))]
        else:
            hierarchical = not hierarchical
        if s.streams == 1 and streams > 1 and move == 0:
            unit = rng.choice(self.units_mb)
        return self.canonical(Striping(streams, unit, hierarchical))

    def random_unmeasured(self, measured: dict[Striping, float], rng: random.Random) -> Optional[Striping]:
        left = [s for s in self.all() if s not in measured]
        return rng.choice(left) if left else None
