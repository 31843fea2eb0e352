"""Module buffers (BatchNorm statistics) broadcast from rank 0 exactly where DDP broadcasts them."""

from __future__ import annotations

import torch
from torch import nn

from commsched.comm.links import Link


class BufferSync:
    """DDP broadcasts buffers before a forward iff the previous forward ran with grad and with sync."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.needed = True

    def before_forward(self, module: nn.Module, link: Link) -> None:
        if self.enabled and self.needed:
            buffers = list(module.buffers())
            if buffers:
                link.broadcast_tensors(buffers, src=0, tag="buffers")

    def after_forward(self, sync_enabled: bool) -> None:
        self.needed = torch.is_grad_enabled() and sync_enabled
