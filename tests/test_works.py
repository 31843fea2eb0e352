"""`commsched.comm.links.Pending` between its two threads: the issuer thread that issues a collective and
the training thread that asks for continuations (a local sum, a copy) on it. A continuation asked
for at any moment runs before `wait()` returns, including in the few bytecodes between the issuer
chaining what was asked before and saying the collective is issued."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

from commsched.comm.links import Issuer, Pending
from commsched.errors import PeerFailureError


@pytest.fixture
def one_process_group(tmp_path):
    """A real gloo group of one process: its collectives are real `dist.Work`s."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class AsksWhileIssuing(threading.Event):
    """The issuer's `set()` (inside `issued()`, after it chained what was asked before): from there,
    another thread asks for a continuation, and `set()` goes on only once that call returned or
    half a second passed. Without the lock the call returns at once and finds the collective not yet
    issued, every time; with it, the call waits for `issued()` to finish."""

    def __init__(self, pending: Pending, ran: list[str]) -> None:
        super().__init__()
        self.asker = threading.Thread(target=lambda: pending.then(lambda: ran.append("local sum")))

    def set(self) -> None:
        self.asker.start()
        self.asker.join(timeout=0.5)
        super().set()


def test_a_continuation_asked_for_while_the_issuer_finishes_is_not_lost(one_process_group):
    pending = Pending("all_reduce of a test tensor")
    ran: list[str] = []
    pending._issued = asking = AsksWhileIssuing(pending, ran)
    pending.issued(dist.all_reduce(torch.ones(3), async_op=True))
    asking.asker.join()
    pending.wait()
    assert ran == ["local sum"]


@pytest.mark.parametrize("queued", [False, True], ids=["issued-at-once", "queued"])
def test_a_second_stage_is_not_issued_after_its_first_stage_failed(one_process_group, queued):
    """On both paths of the issuer: at once (the predecessor already complete) and from its queue."""
    issuer = Issuer("test", timeout_s=60)
    first = Pending("first stage")
    first.failed(PeerFailureError("commsched: the first stage failed"))
    launched: list[int] = []

    def launch() -> dist.Work:
        launched.append(1)
        return dist.all_reduce(torch.ones(1), async_op=True)

    try:
        second = issuer.request(Pending("second stage"), launch, after=first, offload=queued)
        with pytest.raises(PeerFailureError, match="the first stage failed"):
            second.wait()
        assert launched == []
    finally:
        issuer.stop()


def test_continuations_asked_for_at_random_moments_all_run_in_order(one_process_group):
    """An offloaded request, as gloo's reduce-scatter is, with its continuations asked for while the
    issuer thread may be issuing it: every one runs, in the order asked, before wait() returns."""
    issuer = Issuer("test", timeout_s=60)
    rng = random.Random(0)
    try:
        for i in range(300):
            tensor = torch.full((4,), float(i))
            pending = issuer.request(
                Pending(f"all_reduce {i}"), lambda t=tensor: dist.all_reduce(t, async_op=True), offload=True
            )
            ran: list[int] = []
            for k in range(3):
                if rng.random() < 0.5:
                    time.sleep(rng.random() * 1e-4)
                pending.then(lambda k=k: ran.append(k))
            pending.wait()
            assert ran == [0, 1, 2], f"request {i}: continuations run {ran}"
    finally:
        issuer.stop()


def test_a_local_error_in_a_continuation_is_named_for_what_it_is(one_process_group):
    """A shape error in the local sum after a collective is this process's bug, not a dead peer."""
    issuer = Issuer("test", timeout_s=60)
    try:
        pending = issuer.request(
            Pending("all_reduce of bucket 0"), lambda: dist.all_reduce(torch.ones(3), async_op=True)
        )
        pending.then(lambda: torch.ones(3) + torch.ones(4))
        with pytest.raises(RuntimeError) as raised:
            pending.wait()
        assert not isinstance(raised.value, PeerFailureError)
        assert "size of tensor a (3) must match" in str(raised.value)
        assert "this process's own work on all_reduce of bucket 0 (no peer failed)" in raised.value.__notes__[0]
    finally:
        issuer.stop()


@pytest.mark.parametrize(
    "error, local",
    [
        (ValueError("bad shape"), True),
        (AssertionError("invariant"), True),
        (dist.DistBackendError("Connection closed by peer"), False),
    ],
)
def test_a_launch_that_raises_is_local_unless_the_backend_raised(one_process_group, error, local):
    def launch():
        raise error

    issuer = Issuer("test", timeout_s=60)
    try:
        pending = issuer.request(Pending("reduce_scatter of bucket 1"), launch, offload=True)
        with pytest.raises(Exception) as raised:
            pending.wait()
        if local:
            assert raised.value is error
        else:
            assert isinstance(raised.value, PeerFailureError) and "a peer process probably died" in str(raised.value)
    finally:
        issuer.stop()


def test_a_collective_is_traced_and_counted_when_it_is_sent_not_when_asked_for(one_process_group):
    """A request that waits for its predecessor is in the trace (and in the bytes sent) only once the
    issuer has sent it; a launch that raised sent nothing and is in neither."""
    from commsched.comm.links import Link

    trace: list = []
    link = Link("primary", None, trace)
    gate = Pending("a predecessor still on the network")
    link.all_reduce(torch.ones(4), "second", after=gate)
    assert trace == [] and link.wire_bytes == 0  # asked for, not sent
    gate.issued(dist.all_reduce(torch.ones(1), async_op=True))
    deadline = time.monotonic() + 10
    while not trace and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(r.link, r.op, r.tag) for r in trace] == [("primary", "all_reduce", "second")]
    failing = link._request(
        "all_reduce", "refused", torch.ones(2), lambda: (_ for _ in ()).throw(ValueError("bad")), 2.0
    )
    with pytest.raises(ValueError):
        failing.wait()
    assert [r.tag for r in trace] == ["second"]
    link.stop()


def test_a_blocking_collective_waits_for_the_requests_before_it(one_process_group):
    """`Link.broadcast_object` goes after the collectives requested before it on the same link."""
    from commsched.comm.links import Link

    trace: list = []
    link = Link("primary", None, trace)
    gate = Pending("a predecessor still on the network")
    queued = link.all_reduce(torch.ones(4), "queued", after=gate)
    threading.Timer(0.3, lambda: gate.issued(dist.all_reduce(torch.ones(1), async_op=True))).start()
    assert link.broadcast_object({"plan": 1}, 0, "plan") == {"plan": 1}
    assert queued._issued.is_set(), "the broadcast overtook a collective requested before it"
    assert [r.tag for r in trace] == ["queued", "plan"]
    link.stop()


def test_only_the_training_loops_own_waits_count_as_exposed_communication(one_process_group):
    """A second stage waits in the link's queue for its first (DeAR's all-gather for its reduce-scatter):
    the issuer thread's wait is not the loop's, and counting it made the profiler's forward time
    negative (the loop's forward minus waits that ran beside it)."""
    from commsched.comm.links import Link, WaitClock

    link = Link("primary", None, [])
    first_clock = WaitClock()
    first = Pending("a first stage still on the network", first_clock)
    second = link.all_reduce(torch.ones(4), "second stage", after=first)
    threading.Timer(0.3, lambda: first.issued(dist.all_reduce(torch.ones(1), async_op=True))).start()
    time.sleep(0.6)  # the loop computes while the first stage finishes and the second goes out
    second.wait()
    first.wait()
    assert first_clock.seconds < 0.1, "the issuer thread's wait for the first stage was counted as the loop's"
    assert link.clock.seconds < 0.1
    link.stop()
