"""PowerSGD's state in commsched's checkpoints (torch and Lightning save none of it).

`PowerSGDState` keeps by bucket index: each rank's error feedback (training signal: the part of its
gradients the low-rank approximation has not sent yet) and the Q matrices of the last step (equal on
every rank, a warm start), plus a step count and the random state Q is drawn from. Buckets are
numbered per run, so the checkpoint keys the error by parameter name (or, where the hook flattened a
whole bucket into one padded matrix, by the names of the bucket's parameters), and Q (with P, whose
presence tells the hook to reuse Q rather than allocate afresh) by the bucket's parameter names: a
resume on the same layout continues exactly, and error feedback moves to another world size like any
residual (its sum over ranks is what the ranks owe).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from commsched.comm.buckets import Bucket, BucketPlan
from commsched.say import say

POWERSGD_ERROR = "powersgd_error"
"""The per-rank kind of PowerSGD's error feedback (`commsched.state.SUMMABLE`)."""


def powersgd_state(state: Any) -> Any:
    """`state` if it is torch's `PowerSGDState` (the only hook state commsched knows how to save), else None."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    return state if isinstance(state, PowerSGDState) else None


_ASSIGNED: dict[int, Any] = {}
"""id(PowerSGDState) -> the process group commsched gave it (where the user gave none)."""


def give_group(state: Any, group: Any) -> None:
    """A `PowerSGDState` that names no process group gets `group` (the hook's own); one that commsched gave
    a group before, which a finished fit destroyed, gets this fit's."""
    powersgd = powersgd_state(state)
    if powersgd is None:
        return
    if powersgd.process_group is None or powersgd.process_group is _ASSIGNED.get(id(powersgd)):
        powersgd.process_group = group
        _ASSIGNED[id(powersgd)] = group


def layout_key(bucket: Bucket) -> str:
    """A bucket named by its parameters: the same layout has the same key in every run."""
    return "bucket:" + "|".join(bucket.names)


def shared_state(state: Any, plan: BucketPlan) -> dict[str, Any]:
    """What is equal on every rank: the step count, the random state, the Q matrices by layout key."""
    powersgd = powersgd_state(state)
    if powersgd is None:
        return {}
    kind, keys, position, has_gauss, gauss = powersgd.rng.get_state()
    low_rank = {
        layout_key(bucket): {
            "q": powersgd.q_memory_dict[bucket.index].detach().clone(),
            "p": powersgd.p_memory_dict[bucket.index].detach().clone(),  # its size tells the hook Q is there
        }
        for bucket in plan.buckets
        if bucket.index in powersgd.q_memory_dict and bucket.index in powersgd.p_memory_dict
    }
    return {
        "iter": int(powersgd.iter),
        "rng": [kind, torch.as_tensor(keys, dtype=torch.int64), int(position), int(has_gauss), float(gauss)],
        "low_rank": low_rank,
    }


def load_shared(state: Any, saved: Optional[dict[str, Any]], plan: BucketPlan) -> None:
    """Into the run's `PowerSGDState` (the user's object, fresh): the checkpoint's step count, random state
    and, for buckets of the same layout, Q; a bucket without its Q starts a new warm start, said once."""
    powersgd = powersgd_state(state)
    if powersgd is None or not saved:
        return
    kind, keys, position, has_gauss, gauss = saved["rng"]
    powersgd.rng.set_state((kind, keys.numpy().astype("uint32"), position, has_gauss, gauss))
    powersgd.iter = saved["iter"]
    powersgd.q_memory_dict.clear()  # this run's own, replaced by the checkpoint's (a load mid-run)
    powersgd.p_memory_dict.clear()
    missing = 0
    for bucket in plan.buckets:
        kept = saved["low_rank"].get(layout_key(bucket))
        if kept is None:
            missing += bool(saved["low_rank"])
            continue
        powersgd.q_memory_dict[bucket.index] = kept["q"].to(bucket.buffer.device, copy=True)
        powersgd.p_memory_dict[bucket.index] = kept["p"].to(bucket.buffer.device, copy=True)
    if missing:
        say(
            f"commsched: {missing} bucket(s) differ from the checkpoint's layout: PowerSGD draws their Q matrices "
            "afresh (a new warm start; the error feedback is kept by parameter name)"
        )
