"""Links on their own, in real gloo processes (world 4 = 2 nodes x 2 workers for the sub-groups).

- a continuation runs on the backend's thread as soon as its collective completes (nobody waits);
- a second stage requested with `after=` its first stage is issued once the first stage and its
  continuation are done, in request order: with a random delay per rank and step inside the
  continuation, and the training thread issuing other collectives on the same link meanwhile,
  every rank still issues the same sequence and every result is right;
- a chain of 3000 collectives (`InOrder`) runs without recursion;
- sub-group links (one group per node, one per local rank) and streams: each rank's group holds
  the right ranks and its collectives reduce over them alone;
- many tensors broadcast as one message (a module's buffers): every dtype, strides, a 0-d and an
  empty tensor arrive as the source's, in place, and the source's own are left alone.

Usage: python run_links.py OUT_DIR
"""

from __future__ import annotations

import random
import sys
import threading
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from commsched.comm.link_groups import Links, LinkSpec, local_rank_groups, node_groups
from commsched.comm.local_workers import run_workers

WORLD, PER_NODE = 4, 2


def check(rank: int, out: str) -> None:
    trace: list = []
    links = Links(
        [
            LinkSpec("primary", "gloo"),
            LinkSpec("secondary", "gloo", streams=2),
            LinkSpec("intra", "gloo", groups=node_groups(WORLD, PER_NODE)),
            LinkSpec("inter", "gloo", groups=local_rank_groups(WORLD, PER_NODE)),
        ],
        timedelta(seconds=60),
        trace,
    )
    continuation_runs_by_itself(links, rank)
    second_stages_keep_their_place(links, rank)
    long_chains_do_not_recurse(links)
    sub_groups_and_streams(links, rank)
    tensors_arrive_as_the_source_sent_them(links, rank)
    torch.save([tuple(vars(r).values()) for r in trace], Path(out) / f"trace.rank{rank}.pt")
    links.destroy()
    if rank == 0:
        Path(out, "ok").write_text("ok")


def continuation_runs_by_itself(links: Links, rank: int) -> None:
    ran = threading.Event()
    first = torch.full((1000,), float(rank + 1))
    pending = links["primary"].all_reduce(first, "first").then(ran.set)
    deadline = time.monotonic() + 20
    while not ran.is_set() and time.monotonic() < deadline:  # no wait(): the continuation must run by itself
        time.sleep(0.01)
    assert ran.is_set(), "the continuation did not run when the collective completed"
    pending.wait()
    assert torch.all(first == sum(range(1, WORLD + 1)))


def second_stages_keep_their_place(links: Links, rank: int) -> None:
    delays = random.Random(rank)
    primary, secondary = links["primary"], links["secondary"]
    stages, others = [], []
    for step in range(20):
        first = torch.full((4096,), float(rank + step))
        second = torch.zeros(4096)

        def decompress(first: torch.Tensor = first, second: torch.Tensor = second) -> None:
            time.sleep(delays.uniform(0, 0.03))  # a slow local stage, different on every rank
            second.copy_(first * 2)

        done = primary.all_reduce(first, f"first-{step}").then(decompress)
        stages.append((secondary.all_reduce(second, f"second-{step}", after=done), second, step))
        time.sleep(delays.uniform(0, 0.03))  # the training thread's own pace differs too
        other = torch.full((64,), float(rank))
        others.append((secondary.all_reduce(other, f"other-{step}"), other))
    total = sum(range(WORLD))
    for pending, second, step in stages:
        pending.wait()
        assert torch.all(second == 2 * WORLD * (total + WORLD * step)), (step, second[0])
    for pending, other in others:
        pending.wait()
        assert torch.all(other == total)


def long_chains_do_not_recurse(links: Links) -> None:
    tensors = [torch.ones(4) for _ in range(3000)]
    chain = links["primary"].in_order(
        [partial(lambda t, after: links["primary"].all_reduce(t, "chain", after=after), t) for t in tensors]
    )
    chain.wait(len(tensors) - 1)
    assert all(torch.all(t == WORLD) for t in tensors)


def sub_groups_and_streams(links: Links, rank: int) -> None:
    node, local = rank // PER_NODE, rank % PER_NODE
    intra, inter = links["intra"], links["inter"]
    assert (intra.world_size, inter.world_size) == (PER_NODE, WORLD // PER_NODE)
    assert (intra.rank, inter.rank) == (local, node)
    x = torch.full((8,), float(rank))
    intra.all_reduce(x, "intra").wait()
    assert torch.all(x == sum(node * PER_NODE + l for l in range(PER_NODE)))
    y = torch.full((8,), float(rank))
    inter.all_reduce(y, "inter").wait()
    assert torch.all(y == sum(n * PER_NODE + local for n in range(WORLD // PER_NODE)))
    full = torch.zeros(2 * PER_NODE)
    intra.all_gather(full, torch.full((2,), float(rank)), "intra-gather").wait()
    assert full.tolist() == [float(node * PER_NODE + l) for l in range(PER_NODE) for _ in range(2)]
    z = torch.ones(8)
    intra.broadcast(z.fill_(float(rank)), 1, "intra-broadcast").wait()
    assert torch.all(z == node * PER_NODE + 1)
    streams = links.streams("secondary")
    assert [s.name for s in streams] == ["secondary", "secondary.1"]
    works = [(s.all_reduce(t, f"stream{i}"), t) for i, (s, t) in enumerate((s, torch.ones(100)) for s in streams)]
    for pending, t in works:
        pending.wait()
        assert torch.all(t == WORLD)
    assert dist.get_world_size() == WORLD


def tensors_arrive_as_the_source_sent_them(links: Links, rank: int) -> None:
    def made_by(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [
            torch.randn(3, 5, generator=g),
            torch.randint(-9, 9, (7,), generator=g),
            torch.rand(3, generator=g) > 0.5,
            torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
            torch.tensor(float(seed)),
            torch.empty(0),
            torch.randn(3, generator=g).half(),
            torch.randn(2, dtype=torch.complex128, generator=g),
            torch.randn(5, 4, generator=g).t(),
            torch.randn(10, generator=g)[::2],
        ]

    source = 1
    tensors, sent = made_by(rank), made_by(source)
    storages = [t.data_ptr() for t in tensors]
    links["primary"].broadcast_tensors(tensors, source, "buffers")
    for got, expected in zip(tensors, sent):
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    assert [t.data_ptr() for t in tensors] == storages, "copied into, not replaced"
    assert tensors[3].is_contiguous(memory_format=torch.channels_last)
    assert not tensors[8].is_contiguous() and not tensors[9].is_contiguous()


if __name__ == "__main__":
    run_workers(WORLD, check, sys.argv[1])
