"""Communication cost models the simulator and the planners share.

Two kinds: `AlphaBeta` scales a point-to-point link (latency `alpha` seconds, `beta` seconds per
byte) to any worker count with the textbook cost of an algorithm ([DeAR] Eq. 3-5 for the ring,
[MG-WFBP] Table II for double binary trees); `Fitted` is what the link probe measured on a real
group: one straight line `a + b * bytes` per collective, valid only at the world size it was
measured on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from commsched.errors import bad_value

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
ALGORITHMS = ("ring", "tree")


class CostModel(Protocol):
    def time(self, collective: str, nbytes: float, workers: int) -> float:
        """Seconds one collective over `nbytes` of the full (unsharded) buffer takes."""


@dataclass(frozen=True)
class AlphaBeta:
    """Ring: reduce-scatter = all-gather = (P-1)(alpha + m/P beta), all-reduce their sum.
    Tree (NCCL's double binary trees, pipelined): reduce = broadcast = log2(P) alpha + m beta,
    all-reduce their sum; DeAR's decoupling is then reduce + broadcast ([DeAR] §VII)."""

    alpha: float
    beta: float
    algorithm: str = "ring"

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise bad_value("algorithm", self.algorithm, ALGORITHMS)
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got alpha={self.alpha}, beta={self.beta}")

    def half(self, nbytes: float, workers: int) -> float:
        """One of the two halves an all-reduce decouples into."""
        if workers <= 1:
            return 0.0
        if self.algorithm == "ring":
            return (workers - 1) * (self.alpha + nbytes / workers * self.beta)
        return math.ceil(math.log2(workers)) * self.alpha + nbytes * self.beta

    def time(self, collective: str, nbytes: float, workers: int) -> float:
        if collective not in COLLECTIVES:
            raise bad_value("collective", collective, COLLECTIVES)
        half = self.half(nbytes, workers)
        return 2 * half if collective == "all_reduce" else half

    def __str__(self) -> str:
        return (
            f"{self.algorithm}, {8 / self.beta / 1e9:g} Gbit/s, alpha {self.alpha * 1e6:g} us"
            if self.beta
            else f"{self.algorithm}, infinite bandwidth"
        )

    @classmethod
    def from_rate(cls, bits_per_second: float, alpha: float, algorithm: str = "ring") -> "AlphaBeta":
        return cls(alpha=alpha, beta=8.0 / bits_per_second, algorithm=algorithm)


@dataclass(frozen=True)
class Line:
    """t(m) = a + b m, fitted by least squares; `residual` is the root-mean-square error in seconds."""

    a: float
    b: float
    residual: float = 0.0

    def __call__(self, nbytes: float) -> float:
        return self.a + self.b * nbytes


@dataclass(frozen=True)
class Fitted:
    """Costs measured by the link probe on `workers` processes (commsched.profile.probe)."""

    workers: int
    lines: dict[str, Line] = field(default_factory=dict)

    def time(self, collective: str, nbytes: float, workers: int) -> float:
        if workers != self.workers:
            raise ValueError(
                f"the link was probed with {self.workers} workers and cannot predict {workers}; "
                "use an alpha-beta model (--alpha/--bandwidth) to extrapolate"
            )
        if collective not in self.lines:
            raise bad_value("collective", collective, tuple(self.lines))
        return max(0.0, self.lines[collective](nbytes))

    def __str__(self) -> str:
        return f"fitted on {self.workers} workers: " + ", ".join(
            f"{k} {v.a * 1e6:.0f} us + {8 / v.b / 1e9 if v.b else float('inf'):.2f} Gbit/s"
            for k, v in self.lines.items()
        )

    def to_dict(self) -> dict:
        return {"workers": self.workers, **{k: vars(v) for k, v in self.lines.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "Fitted":
        return cls(int(data["workers"]), {k: Line(**data[k]) for k in COLLECTIVES if k in data})


@dataclass(frozen=True)
class Measured:
    """Collective times measured on `workers` processes at a few sizes (e.g. each bucket alone),
    interpolated piecewise-linearly and extended along the end segments: exact at the measured
    sizes, which a straight-line fit is not when small messages cost more than alpha-beta says.
    A message never costs more than a larger one: each point is lowered to the cheapest time
    measured at any size >= its own, which removes the upward noise small timings carry (a
    scheduler hiccup during a 50 us collective doubles it)."""

    workers: int
    points: dict[str, tuple[tuple[float, float], ...]]

    def time(self, collective: str, nbytes: float, workers: int) -> float:
        if workers != self.workers:
            raise ValueError(f"measured with {self.workers} workers, cannot predict {workers}")
        if collective not in self.points:
            raise bad_value("collective", collective, tuple(self.points))
        points = _monotone(sorted(dict(self.points[collective]).items()))
        if len(points) == 1:
            ((m0, t0),) = points
            return t0 * nbytes / m0 if m0 else t0
        index = next((i for i in range(1, len(points)) if nbytes <= points[i][0]), len(points) - 1)
        (m0, t0), (m1, t1) = points[index - 1], points[index]
        return max(0.0, t0 + (t1 - t0) * (nbytes - m0) / (m1 - m0))

    def __str__(self) -> str:
        return f"measured on {self.workers} workers at {len(next(iter(self.points.values()), ()))} sizes"


def _monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    cheapest, out = float("inf"), []
    for size, seconds in reversed(points):
        cheapest = min(cheapest, seconds)
        out.append((size, cheapest))
    return out[::-1]
