"""In-flight collectives (`Pending`) and the order a link issues them in (`Issuer`).

The rule that keeps every rank in lock-step: on each link, collectives are issued in the order
they were *requested*, and only the training thread requests, in program order (the same on every
rank). A request may have to wait before it can be issued: for another collective to complete
(`after`: the one before it in a chain, as DeAR's all-gathers in the order the next forward needs
them; or the first stage of a two-stage exchange, whose continuations -- a local sum, a
decompression -- then have run too), or for its input to land in host memory (`ready`: a gloo
link staging a CUDA bucket). Such a request waits in the link's queue, with everything requested
after it on that link, while the training thread goes on; the link's issuer thread issues them
in order. A request with nothing to wait for on an idle link is issued at once by the requesting
thread. No collective is ever issued from a backend's completion thread: a second stage is
requested by the training thread with `after=` its first stage, so it never interleaves with the
training thread's collectives on its group, and a chain of any length is a loop, not a recursion.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from commsched.comm import peers
from commsched.errors import PeerFailureError

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
