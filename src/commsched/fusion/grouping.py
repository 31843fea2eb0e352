"""The shared loop of every contiguous planner: walk parameters in ready order, cut where told."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ParamInfo:
    """What a planner may know about one parameter (no tensors, so plans are cheap to hash and send)."""

    name: str
    numel: int
    element_size: int
    dtype: torch.dtype
    device: torch.device
    layer: int  # index of the module that owns it, in the same ready order

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def group_contiguous(params: Sequence[ParamInfo], cut_before: Callable[[list[int], int], bool]) -> list[list[int]]:
    """Split `0..len(params)-1` into runs; a new run starts when `cut_before(run, i)` says so.

    A run also always ends where dtype or device changes: a bucket is one flat buffer.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    for i, info in enumerate(params):
        if current:
            first = params[current[0]]
            if info.dtype != first.dtype or info.device != first.device or cut_before(current, i):
                groups.append(current)
                current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
