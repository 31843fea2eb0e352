"""Let Lightning run its whole optimizer step (closure, hooks, clipping) while a schedule decides
what `optimizer.step` does: DeAR defers it to the next forward, DeFT takes it only when a
generation is complete."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from itertools import chain
from typing import Any, Callable, Iterator, Optional

from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

RealStep = Callable[..., Any]


def run_with_step_replaced(
    optimizer: Optimizer, run_step: Callable[[], Any], instead: Callable[[RealStep, dict[str, Any]], None]
) -> Any:
    """Run `run_step` with `optimizer.step(closure)` running the closure, then `instead(quiet_step, kwargs)`.

    The step hooks users register (`register_step_pre_hook`, `register_step_post_hook`, torch's global
    ones: EMA, schedule-free and logging libraries hook there) run once per optimizer step, around the
    whole of it (`hooked_step`), with the param groups and hyper-parameters the user set, as under ddp;
    `quiet_step`, the optimizer's own step without them, may be called any number of times, on part of
    the parameters (DeAR steps bucket by bucket) or with other values (DGC's zeroed momentum)."""
    real_step = optimizer.step
    had_instance_step = "step" in optimizer.__dict__

    def replaced(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        def body(quiet_step: RealStep, kwargs: dict[str, Any]) -> Any:
            closure = kwargs.get("closure")
            loss = closure() if closure is not None else None
            instead(quiet_step, {k: v for k, v in kwargs.items() if k != "closure"})
            return loss

        return hooked_step(optimizer, real_step, {"closure": closure, **kwargs}, body)

    optimizer.step = replaced  # type: ignore[method-assign]
    try:
        return run_step()
    finally:
        if had_instance_step:
            optimizer.step = real_step  # type: ignore[method-assign]
        else:
            del optimizer.step


def hooked_step(
    optimizer: Optimizer, real_step: RealStep, kwargs: dict[str, Any], body: Callable[[RealStep, dict[str, Any]], Any]
) -> Any:
    """One optimizer step as torch's own runs it: the pre-hooks (which may give new kwargs), then
    `body(quiet_step, kwargs)` in place of the step, then the post-hooks."""
    args, kwargs = _run_pre_hooks(optimizer, kwargs)

    def quiet_step(**step_kwargs: Any) -> Any:
        with _hooks_silenced(optimizer):
            return real_step(**step_kwargs)

    result = body(quiet_step, kwargs)
    for hook in chain(
        optimizer._optimizer_step_post_hooks.values(), torch_optimizer._global_optimizer_post_hooks.values()
    ):
        hook(optimizer, args, kwargs)
    return result


def _run_pre_hooks(optimizer: Optimizer, kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """torch's order and contract: global hooks first, each may return new `(args, kwargs)`."""
    args: tuple[Any, ...] = (optimizer,)
    for hook in chain(
        torch_optimizer._global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values()
    ):
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"an optimizer step pre-hook must return None or a tuple (new_args, new_kwargs), got {result!r}"
                )
            args, kwargs = result
    return args, kwargs


@contextlib.contextmanager
def _hooks_silenced(optimizer: Optimizer) -> Iterator[None]:
    """The step hooks (the optimizer's own and torch's global ones) out of the way for one call.

    The dicts are replaced by empty ones, never emptied: a partial step may run from inside a hook
    (a pre-hook that reads a pending weight applies it), while torch or `_run_pre_hooks` iterates
    the very dict the hook came from. A hook registered meanwhile joins the user's dicts after."""
    owned = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks)
    shared = (torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks)
    quiet = [OrderedDict() for _ in range(4)]
    optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = quiet[0], quiet[1]
    torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks = quiet[2], quiet[3]
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = owned
        torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks = shared
        for hooks, added in zip((*owned, *shared), quiet):
            hooks.update(added)
