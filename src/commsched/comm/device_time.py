"""Timing what a collective costs *to complete*, on the device it runs on.

On the CPU (gloo) a collective's future completes when the transfer has, and the host clock is the
truth. On CUDA (NCCL) a collective's future completes when it is *enqueued*, and `wait()` only
makes the current stream wait: timing either measures a launch. So on CUDA a timing ends with a
CUDA event recorded on a stream that waited for the collective, or (in measuring steps only)
with a device synchronize. Every consumer of timings goes through here: the profiler, the link
probe, DeFT's measurements, and through them the planners and the simulator's inputs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Protocol

import torch

from commsched.trace import Span


class Completion(Protocol):
    """What a span ends on: a link's in-flight collective (`commsched.comm.links.Pending`)."""

    def wait(self) -> Any: ...

    def then(self, callback: Callable[[], Any]) -> Any: ...


def synchronize(device: torch.device) -> None:
    """Wait until `device` has finished everything enqueued (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_done(device: torch.device) -> None:
    """Wait until the model's own stream (the current one) has run everything enqueued on it; not the
    collectives' streams. A step boundary read after it is when that step's compute completed (the
    host may otherwise run steps ahead of the GPU), while an exchange the schedule overlaps with the
    next step (DeAR's all-gathers) goes on. Nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class StreamMarks:
    """Spans between moments of the model's stream: on CUDA an event recorded there, read once the
    stream has passed it (nothing is synchronised on the way, so the host still queues ahead); on the
    CPU the host clock. A span is then when the stream reached its end less when it reached its start:
    a step whose compute the host queued ahead counts that compute, and one the GPU spent waiting for
    the host counts the wait."""

    def __init__(self) -> None:
        self._open: list[tuple[Any, Any]] = []
        self._seconds: list[float] = []

    @staticmethod
    def mark(device: torch.device) -> Any:
        """This moment of `device`'s current stream."""
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def add(self, start: Any, end: Any) -> None:
        if isinstance(end, float):
            self._seconds.append(end - start)
            return
        self._open.append((start, end))
        self._close(wait=False)

    def __len__(self) -> int:
        return len(self._seconds) + len(self._open)

    def seconds(self) -> list[float]:
        """Every span so far (waits for the stream to pass the last one)."""
        self._close(wait=True)
        return list(self._seconds)

    def _close(self, wait: bool) -> None:
        while self._open and (wait or self._open[0][1].query()):
            start, end = self._open.pop(0)
            end.synchronize()
            self._seconds.append(start.elapsed_time(end) / 1e3)


def seconds_of(device: torch.device, run: Callable[[], object]) -> float:
    """Wall seconds until everything `run` enqueued on `device` has completed."""
    synchronize(device)
    started = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - started


def median_seconds(
    fn: Callable[[], object], repeats: int, warmup: int = 1, device: torch.device = torch.device("cpu")
) -> float:
    """Median seconds until what `fn` started has completed on `device` (`seconds_of`), after `warmup`
    untimed calls: the profiler's collectives, the link probe and DeFT's halves are timed with it."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds_of(device, fn) for _ in range(repeats))


class Stopwatch:
    """Started when made; `stop_when(pending)` stops it when that collective completes (call
    `pending.wait()` after it on the CPU); `seconds` reads it."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._end_time: Optional[float] = None
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(device))
        else:
            self._started = time.perf_counter()

    def stop_when(self, pending: Completion) -> None:
        if self._cuda:
            pending.wait()  # the current stream now waits for the collective
            self._end.record(torch.cuda.current_stream(self._device))
        else:
            pending.then(self._mark)

    def _mark(self) -> None:
        self._end_time = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        assert self._end_time is not None, "Stopwatch: wait for the collective before reading the time"
        return self._end_time - self._started


class SpanRecorder:
    """Launch-to-completion spans of a link's collectives, for the profiler's trace: host times of
    the completion on the CPU; on CUDA, events (a side stream waits for each collective) turned into
    host times against an event recorded when the recorder was made."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._spans: list[Span] = []
        self._events: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        if device.type == "cuda":
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record(torch.cuda.current_stream(device))
            self._origin_time = time.perf_counter()
            self._side = torch.cuda.Stream(device)

    def around(self, lane: str, name: str, launch: Callable[[], "torch.distributed.Work"]) -> "torch.distributed.Work":
        if self._device.type != "cuda":
            started = time.perf_counter()
            work = launch()
            work.get_future().add_done_callback(
                lambda _: self._spans.append(Span(lane, name, started, time.perf_counter()))
            )
            return work
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self._device))
        work = launch()
        with torch.cuda.stream(self._side):
            work.wait()  # the side stream waits for the collective; the training stream does not
            end.record(self._side)
        self._events.append((lane, name, start, end))
        return work

    def spans(self) -> list[Span]:
        """Every span so far, in host time (waits for the device on CUDA)."""
        if self._events:
            synchronize(self._device)
            self._spans += [
                Span(lane, name, self._host(start), self._host(end)) for lane, name, start, end in self._events
            ]
            self._events.clear()
        return list(self._spans)

    def _host(self, event: torch.cuda.Event) -> float:
        return self._origin_time + self._origin.elapsed_time(event) / 1e3
