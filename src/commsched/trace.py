"""Timelines as spans on named lanes, and their export as a Chrome trace (chrome://tracing, Perfetto).

The profiler records real spans (one compute lane and one lane per link, per rank); the simulator
produces the same kind for a predicted iteration, so both open in the same viewer side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from commsched.run_files import write_json


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    rank: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


def chrome_trace(spans: Iterable[Span]) -> dict:
    """Complete events ("ph": "X") in microseconds; process = rank, thread = lane."""
    spans = list(spans)
    lanes: dict[tuple[int, str], int] = {}
    for span in spans:
        lanes.setdefault((span.rank, span.lane), len([k for k in lanes if k[0] == span.rank]))
    events: list[dict] = []
    for rank in sorted({rank for rank, _ in lanes}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
    for (rank, lane), tid in lanes.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    for span in spans:
        events.append(
            {
                "ph": "X",
                "name": span.name,
                "cat": span.lane,
                "pid": span.rank,
                "tid": lanes[(span.rank, span.lane)],
                "ts": span.start * 1e6,
                "dur": max(span.seconds, 0.0) * 1e6,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: Iterable[Span], path: str | Path) -> Path:
    return write_json(Path(path), chrome_trace(spans), indent=None)
