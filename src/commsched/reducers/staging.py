"""A bucket's bytes as the link carries them: on its device (gloo links carry CPU tensors even when the
model is on a GPU) and in its wire dtype (`comm_dtype`: fp32 gradients cast to bf16 or fp16 on the way
out, cast back on the way in, as DDP's compress hooks do).

The host copy is pinned and both copies are asynchronous: `to_link` enqueues the device-to-host
copy on the model's stream and returns an event the link waits for before issuing the collective
(in its own queue: the training thread does not wait); `from_link`, run on the backend's
completion thread, enqueues the host-to-device copy on the model's stream, so everything the
training loop enqueues after waiting for the collective sees the result. On one device both are
no-ops: the collective works on the bucket itself.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from commsched.comm.links import Link


class Staging:
    """Either the bucket buffer itself (same device and dtype) or a copy that collectives use instead
    (pinned host memory for a CUDA bucket on a gloo link; the wire dtype for a low-precision wire)."""

    def __init__(self, buffer: torch.Tensor, link: Link, cast: bool = True) -> None:
        """`cast`: False keeps the buffer's dtype on the wire (a stage whose result is worked on, not only sent)."""
        self.buffer = buffer
        self.device = link.device
        self._copy: Optional[torch.Tensor] = None
        self._stream: Any = None
        wire = link.wire_for(buffer.dtype) if cast else buffer.dtype
        if buffer.device != self.device or wire != buffer.dtype:
            moved = buffer.device != self.device and buffer.device.type == "cuda"
            self._copy = torch.empty(buffer.shape, dtype=wire, device=self.device, pin_memory=moved)
            self._stream = torch.cuda.current_stream(buffer.device) if moved else None  # read on the training thread

    @property
    def tensor(self) -> torch.Tensor:
        """What the collective touches."""
        return self._copy if self._copy is not None else self.buffer

    @property
    def staged(self) -> bool:
        return self._copy is not None

    def to_link(self, start: int = 0, numel: Optional[int] = None) -> Any:
        """Copy (a slice of) the bucket to the link's device; returns the CUDA event to wait for, or None."""
        if self._copy is None:
            return None
        numel = self.buffer.numel() - start if numel is None else numel
        self._copy.narrow(0, start, numel).copy_(
            self.buffer.narrow(0, start, numel), non_blocking=self._stream is not None
        )
        if self._stream is None:
            return None
        ready = torch.cuda.Event()
        ready.record(self._stream)
        return ready

    def from_link(self, start: int = 0, numel: Optional[int] = None) -> None:
        """Copy (a slice of) the result back to the bucket (on the completion thread: on the model's stream)."""
        if self._copy is None:
            return
        numel = self.buffer.numel() - start if numel is None else numel
        source, target = self._copy.narrow(0, start, numel), self.buffer.narrow(0, start, numel)
        if self._stream is None:
            target.copy_(source)
            return
        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)
