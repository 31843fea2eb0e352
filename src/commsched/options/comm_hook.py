"""DDP's communication hooks as commsched's strategies take them (`ddp_comm_hook`, `ddp_comm_state`,
`ddp_comm_wrapper`, the arguments of Lightning's `DDPStrategy`).

torch's plain compress hooks (`allreduce_hook`, `fp16_compress_hook`, `bf16_compress_hook`) say only what
gradients travel as: they are read as `comm_dtype`, which every schedule sends (`options.wire`). Any other
hook (PowerSGD, batched PowerSGD, a wrapper, the user's own) runs on each whole bucket, as DDP runs it:
only where a schedule all-reduces whole buckets. Torch-free: hooks are kept as the objects given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from commsched.errors import bad_value
from commsched.options.wire import TORCH_HOOKS, comm_dtype_from, hook_name


@dataclass(frozen=True)
class CommHook:
    """A DDP communication hook run on each bucket: ``hook(state, bucket) -> Future[Tensor]``."""

    hook: Callable[..., Any]
    """The hook, as given to `DistributedDataParallel.register_comm_hook`."""
    state: Any = None
    """Its state (``PowerSGDState``, a process group, or None: the run's primary link's group)."""
    wrapper: Optional[Callable[..., Any]] = None
    """A wrapper of the hook (torch's ``fp16_compress_wrapper``, ``bf16_compress_wrapper``), applied once."""

    @property
    def name(self) -> str:
        short = hook_name(self.hook).rsplit(".", 1)[-1]
        return f"{hook_name(self.wrapper).rsplit('.', 1)[-1]}({short})" if self.wrapper is not None else short

    def runnable(self) -> Callable[..., Any]:
        return self.wrapper(self.hook) if self.wrapper is not None else self.hook


def hook_and_wire(
    comm_dtype: Any, hook: Any, state: Any, wrapper: Any
) -> tuple[str, Optional[str], Optional[CommHook]]:
    """The wire dtype; the line saying what a torch compress hook was read as (None: nothing to say); and
    the hook to run on whole buckets (None where there is none, or it was read as the wire dtype)."""
    if hook is None:
        for name, given in (("ddp_comm_state", state), ("ddp_comm_wrapper", wrapper)):
            if given is not None:
                raise bad_value(name, given, "None without ddp_comm_hook (it is the hook's state or wrapper)")
        return *comm_dtype_from(comm_dtype), None
    if not callable(hook):
        raise bad_value("ddp_comm_hook", hook, "a callable hook(state, bucket) -> torch.futures.Future")
    if wrapper is not None and not callable(wrapper):
        raise bad_value("ddp_comm_wrapper", wrapper, "a callable wrapper(hook) -> hook, or None")
    if wrapper is None and hook_name(hook) in TORCH_HOOKS:
        return *comm_dtype_from(comm_dtype, hook), None
    wire, _ = comm_dtype_from(comm_dtype)
    if wire != "fp32":
        raise bad_value(
            "comm_dtype", comm_dtype, "'fp32' with ddp_comm_hook (the hook decides what its buckets travel as)"
        )
    return wire, None, CommHook(hook, state, wrapper)


def check_comm_hook(options: Any, schedule: str, runs_hooks: bool) -> None:
    """A hook only where whole buckets are all-reduced, one collective per bucket (torch-free)."""
    hook: Optional[CommHook] = options.comm_hook
    if hook is None:
        return
    if not runs_hooks:
        raise bad_value(
            "ddp_comm_hook",
            hook.name,
            f"None under schedule '{schedule}', which does not all-reduce whole buckets (a hook gets one bucket "
            "and returns its average); schedules that run it: wfbp (strategy='wfbp', WFBPStrategy); torch's "
            "fp16/bf16 compress hooks are taken by every schedule, as comm_dtype",
        )
    if options.compression.method != "none":
        raise bad_value(
            "compression", options.compression.method, "'none' with ddp_comm_hook (the hook is the exchange)"
        )
    if options.streams.count != 1:
        raise bad_value("streams.count", options.streams.count, "1 with ddp_comm_hook (a hook sees whole buckets)")
