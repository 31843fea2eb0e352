"""One bucket summed over all ranks in one collective (wfbp, DeFT).

The capture scaled the gradients by 1/P while copying them into the bucket, as DDP does, so the
sum is the average.
"""

from __future__ import annotations

import torch

from commsched.links import Link, Pending
from commsched.reducers.staging import Staging


class AllReduce:
    def __init__(self, buffer: torch.Tensor, link: Link) -> None:
        self.link = link
        self._staging = Staging(buffer, link)

    def start(self, tag: str) -> Pending:
        """Sum the bucket over ranks; the result is in the bucket when the returned `Pending` completes."""
        self._staging.to_link()
        pending = self.link.all_reduce(self._staging.tensor, tag)
        return pending.then(self._staging.from_link) if self._staging.tensor is not self._staging.buffer else pending
