"""Every rank issues the same collectives in the same order, once per optimizer step (never on
accumulation micro-batches), even when ranks leave different parameters without gradients."""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import per_link


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("schedule", ["wfbp", "dear"])
def test_same_collectives_in_same_order_on_every_rank(cases, world, schedule):
    """Per link (process group), which is where the order matters: DeAR's chained all-gathers are
    launched from the backend's thread, so their records interleave with other links' differently."""
    traces = [per_link(result["trace"]) for result in cases(world).all_ranks(f"{schedule}-sgd")]
    assert traces[0], "no collectives were recorded"
    for rank, trace in enumerate(traces[1:], start=1):
        assert trace == traces[0], f"rank {rank} issued a different sequence of collectives than rank 0"



@pytest.mark.parametrize("world", [2, 3])
def test_dear_communicates_once_per_optimizer_step(cases, world):
    result = cases(world).load("dear-sgd")
    trace, steps = result["trace"], result["global_step"]
    buckets = {tag for _link, op, tag, *_ in trace if op == "reduce_scatter"}
    assert len(buckets) >= 3, "the test is meant to run with several buckets"
    ops = Counter(op for _link, op, *_ in trace)
    assert ops["reduce_scatter"] == steps * len(buckets)
    assert ops["all_gather"] == steps * len(buckets) + 1  # + the plan-hash check at setup
    step_all_reduces = [tag for _link, op, tag, *_ in trace if op == "all_reduce"]
    assert Counter(step_all_reduces) == {"used-mask": steps, "clip-norm": steps}


def test_dear_buckets_padded_to_world_size(cases):
    for world in (2, 3):
        for _link, op, tag, numel, dtype in cases(world).load("dear-sgd")["trace"]:
            if op == "reduce_scatter":
                assert numel % world == 0


def test_wfbp_all_reduces_every_bucket_once_per_step(cases):
    result = cases(3).load("wfbp-sgd")
    trace, steps = result["trace"], result["global_step"]
    buckets = {tag for _link, op, tag, *_ in trace if op == "all_reduce" and tag.startswith("bucket")}
    bucket_reduces = [tag for _link, op, tag, *_ in trace if op == "all_reduce" and tag.startswith("bucket")]
    assert len(bucket_reduces) == steps * len(buckets)
    assert not any(op in ("reduce_scatter", "all_gather") and tag.startswith("bucket") for _link, op, tag, *_ in trace)
