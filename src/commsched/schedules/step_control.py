"""Let Lightning run its whole optimizer step (closure, hooks, clipping) while a schedule decides
what `optimizer.step` does: DeAR defers it to the next forward, DeFT takes it only when a
generation is complete."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch.optim import Optimizer

RealStep = Callable[..., Any]


def run_with_step_replaced(optimizer: Optimizer, run_step: Callable[[], Any],
                           instead: Callable[[RealStep, dict[str, Any]], None]) -> Any:
    """Run `run_step` with `optimizer.step(closure)` running the closure, then `instead(real_step, kwargs)`."""
    real_step = optimizer.step
    had_instance_step = "step" in optimizer.__dict__

    def replaced(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        loss = closure() if closure is not None else None
        instead(real_step, kwargs)
        return loss

    optimizer.step = replaced  # type: ignore[method-assign]
    try:
        return run_step()
    finally:
        if had_instance_step:
            optimizer.step = real_step  # type: ignore[method-assign]
        else:
            del optimizer.step
