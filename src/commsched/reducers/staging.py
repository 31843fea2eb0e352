"""A bucket's bytes on the link's device: gloo links carry CPU tensors even when the model is on a GPU."""

from __future__ import annotations

from typing import Optional

import torch

from commsched.links import Link


class Staging:
    """Either the bucket buffer itself (same device) or a host copy that collectives use instead."""

    def __init__(self, buffer: torch.Tensor, link: Link) -> None:
        self.buffer = buffer
        self.device = link.device
        self._copy: Optional[torch.Tensor] = None
        if buffer.device != self.device:
            pin = buffer.device.type == "cuda" and torch.cuda.is_available()
            self._copy = torch.empty(buffer.shape, dtype=buffer.dtype, device=self.device, pin_memory=pin)

    @property
    def tensor(self) -> torch.Tensor:
        """What the collective touches."""
        return self._copy if self._copy is not None else self.buffer

    def to_link(self) -> None:
        if self._copy is not None:
            self._copy.copy_(self.buffer)

    def from_link(self) -> None:
        if self._copy is not None:
            self.buffer.copy_(self._copy, non_blocking=True)
