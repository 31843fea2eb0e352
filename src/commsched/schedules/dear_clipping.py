"""Gradient clipping under DeAR: after backward each rank holds only its shard of every bucket, so the
global norm is summed from the shards (each rank its part, then one scalar all-reduce), over the
elements that belong to the optimizer being clipped."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.optim import Optimizer

from commsched.comm.buckets import BucketPlan
from commsched.reducers.striped import StripedShards

Segments = list[list[tuple[int, int, int]]]


def optimizer_segments(plan: BucketPlan, reducers: Sequence[StripedShards], optimizer: Optimizer) -> Segments:
    """Per bucket, the (piece, start, length) ranges of this rank's pieces (its shard of each unit)
    that belong to `optimizer`'s parameters."""
    members = {id(p) for g in optimizer.param_groups for p in g["params"]}
    per_bucket = []
    for bucket, reducer in zip(plan.buckets, reducers):
        ranges = []
        for i, (lo, piece) in enumerate(reducer.pieces()):
            hi = lo + piece.numel()
            for p, start in zip(bucket.params, bucket.offsets()):
                a, z = max(start, lo), min(start + p.numel(), hi)
                if id(p) in members and a < z:
                    ranges.append((i, a - lo, z - a))
        per_bucket.append(ranges)
    return per_bucket


def squared_norm(plan: BucketPlan, reducers: Sequence[StripedShards], segments: Segments, whole: bool) -> torch.Tensor:
    """This rank's part of the squared global norm: its shards, or its slices of the whole gradients
    once someone read `.grad` (`whole`)."""
    squares = torch.zeros(1, dtype=torch.float32, device=plan.buckets[0].buffer.device)
    for bucket, reducer, ranges in zip(plan.buckets, reducers, segments):
        pieces = [bucket.buffer.narrow(0, lo, shard.numel()) if whole else shard for lo, shard in reducer.pieces()]
        for i, start, length in ranges:
            squares += torch.linalg.vector_norm(pieces[i].narrow(0, start, length), dtype=torch.float32).square().to(squares.device)
    return squares
