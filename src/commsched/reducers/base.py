"""What every reducer is: how one bucket's bytes are combined across ranks, and the state it keeps.

A schedule builds one reducer per bucket (`Schedule.reducers`). State a reducer keeps across steps
(an error-feedback residual, a compressor's memory) is this rank's and belongs to parameters, not
to the bucket: `state_dict` returns it by kind and parameter name, and `load_state_dict` takes the
parameters of its own bucket back from the same mapping, so the state survives a rebuild, a new
fusion plan and a resume on other buckets. The schedule gathers every reducer's state into its
per-rank communication state (`commsched.state`), and a checkpoint holding a kind of state that no
reducer of this run keeps is refused there, never dropped.
"""

from __future__ import annotations

from typing import Mapping

import torch

from commsched.comm.buckets import Bucket

ReducerState = dict[str, dict[str, torch.Tensor]]
"""kind (e.g. "residual") -> parameter name -> tensor shaped like the parameter."""


class Reducer:
    """Stateless unless a subclass says otherwise (`kinds`)."""

    kinds: tuple[str, ...] = ()
    """The kinds of state this reducer keeps."""

    def state_dict(self) -> ReducerState:
        return {}

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Take this bucket's parameters' entries of each kind in `kinds` (missing ones start at zero)."""

    def live_state(self) -> list[torch.Tensor]:
        """The tensors of that state as the reducer keeps them (copied and restored around a step that
        fp16's scaler skips)."""
        return []


def by_parameter(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """A bucket-shaped tensor split into one copy per parameter name."""
    return {
        name: flat.narrow(0, start, p.numel()).view_as(p).clone()
        for name, p, start in zip(bucket.names, bucket.params, bucket.offsets())
    }


def into_bucket(bucket: Bucket, saved: Mapping[str, torch.Tensor], flat: torch.Tensor) -> None:
    """Fill a bucket-shaped tensor from per-parameter entries (zeros where a parameter has none)."""
    flat.zero_()
    for name, p, start in zip(bucket.names, bucket.params, bucket.offsets()):
        if name in saved:
            flat.narrow(0, start, p.numel()).copy_(saved[name].reshape(-1))
