"""What gradients travel as on the wire (`comm_dtype`), and DDP's communication hooks that say the same.

Lightning users halve their gradient traffic with ``DDPStrategy(ddp_comm_hook=bf16_compress_hook)``;
the same argument given to a commsched strategy is read as the wire dtype it asks for, so that code
written for DDP moves over unchanged. Torch-free: hooks are recognised by their qualified name.
"""

from __future__ import annotations

from typing import Any, Optional

from commsched.errors import bad_value
from commsched.options.catalogue import COMM_DTYPES

TORCH_HOOKS = {
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook": "fp32",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook": "fp16",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook": "bf16",
}
"""torch's DDP communication hooks that are a wire dtype, by qualified name."""


def hook_name(hook: Any) -> str:
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"


def comm_dtype_from(comm_dtype: Any, ddp_comm_hook: Any = None) -> tuple[str, Optional[str]]:
    """The wire dtype `comm_dtype` names, or the one torch's compress hook `ddp_comm_hook` asks for; and
    the line that says which hook was read as what (None without a hook)."""
    if comm_dtype not in COMM_DTYPES:
        raise bad_value("comm_dtype", comm_dtype, COMM_DTYPES)
    if ddp_comm_hook is None:
        return comm_dtype, None
    name = hook_name(ddp_comm_hook)
    if name not in TORCH_HOOKS:
        short = ", ".join(n.rsplit(".", 1)[1] for n in TORCH_HOOKS)
        raise bad_value(
            "ddp_comm_hook",
            name,
            f"one of torch's default_hooks {short} (read as comm_dtype); for a low-precision wire pass "
            f"comm_dtype= one of {', '.join(COMM_DTYPES)}",
        )
    asked = TORCH_HOOKS[name]
    if comm_dtype != "fp32" and comm_dtype != asked:
        raise bad_value("comm_dtype", comm_dtype, f"'{asked}', the dtype ddp_comm_hook={name.rsplit('.', 1)[1]} sends")
    return asked, f"ddp_comm_hook={name.rsplit('.', 1)[1]} is read as comm_dtype='{asked}'"
