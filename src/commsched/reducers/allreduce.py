"""One bucket (or a piece of it) summed over all ranks in one collective (wfbp, DeFT).

The capture scaled the gradients by 1/P while copying them into the bucket, as DDP does, so the
sum is the average.
"""

from __future__ import annotations

from typing import Optional

import torch

from commsched.comm.links import Link, Pending
from commsched.reducers.base import Reducer
from commsched.reducers.staging import Staging


class AllReduce(Reducer):
    def __init__(self, buffer: torch.Tensor, link: Link, staging: Optional[Staging] = None) -> None:
        """`staging`: shared with the bucket's other reducers (streams of one link spec: one host copy)."""
        self.link = link
        self._staging = staging if staging is not None else Staging(buffer, link)

    def start(self, tag: str, start: int = 0, numel: Optional[int] = None) -> Pending:
        """Sum (elements `start..start+numel` of) the bucket over ranks; the result is in the bucket
        when the returned `Pending` completes."""
        numel = self._staging.buffer.numel() - start if numel is None else numel
        ready = self._staging.to_link(start, numel)
        pending = self.link.all_reduce(self._staging.tensor.narrow(0, start, numel), tag, ready=ready)
        if self._staging.staged:
            pending.then(lambda: self._staging.from_link(start, numel))
        return pending
