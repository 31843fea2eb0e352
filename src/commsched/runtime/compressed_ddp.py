"""Lightning's DDP sending gradients as bf16 or fp16: the baseline a low-precision wire is measured against.

Lightning's `DDPStrategy(ddp_comm_hook=bf16_compress_hook)` registers the hook on CUDA only, and torch's
bf16 hook refuses CPU tensors; the compress hooks' body (cast, divide by the world size, all-reduce, copy
back) runs on any device, so this strategy registers it wherever DDP runs, for ``schedule=ddp
comm_dtype=bf16`` in ``commsched-train`` and the bench.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from typing_extensions import override

from commsched.comm.links import WIRE_DTYPES


class CompressedDDP(DDPStrategy):
    def __init__(self, comm_dtype: str, **kwargs: Any) -> None:
        """`comm_dtype`: "bf16" or "fp16" (`WIRE_DTYPES`); the other arguments are `DDPStrategy`'s."""
        super().__init__(**kwargs)
        self.wire_dtype = WIRE_DTYPES[comm_dtype]

    @override
    def _register_ddp_hooks(self) -> None:
        wire = self.wire_dtype

        def compress_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks real annotations, if any
            return default_hooks._compress_hook(wire, state, bucket)

        self.model.register_comm_hook(None, compress_hook)  # type: ignore[union-attr]
