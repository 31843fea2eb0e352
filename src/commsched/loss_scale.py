"""fp16's loss scale (torch's GradScaler, as Lightning's ``precision="16-mixed"`` runs it) under schedules
whose gradients are not whole in `.grad` when the scaler unscales them.

Under DDP, Lightning's precision plugin runs the closure, then `scaler.unscale_(optimizer)` multiplies
every `.grad` by 1/scale and notes whether any is inf or NaN, clipping follows, `scaler.step` skips
`optimizer.step()` if one was, and `scaler.update()` moves the scale. Every rank holds the same averaged
gradient, so every rank finds the same. A schedule that holds only its shard of each bucket then (DeAR),
or that unscaled its gradients before a sparse exchange (top-k's residuals are kept across steps in
unscaled units), answers the scaler itself (`Schedule.unscale_gradients`): it unscales what it holds
and one scalar all-reduce makes any rank's finding every rank's, before any update of the step is
applied. The scaler's own bookkeeping (its stages, `step`, `update`, its checkpoint) is left as it is.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch.optim import Optimizer

Unscale = Callable[[Optimizer, torch.Tensor], Optional[torch.Tensor]]
"""(optimizer, 1/scale) -> the found-inf flag every rank agreed on, or None: unscale `.grad` as torch does."""


def scaler_of(precision_plugin: Any) -> Optional[Any]:
    """The enabled GradScaler of Lightning's precision plugin, if any ("16-mixed"; not bf16 or 32-bit)."""
    scaler = getattr(precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def inverse_scale(scaler: Any) -> torch.Tensor:
    """1/scale computed as `GradScaler.unscale_` computes it (in double, then float), so products match."""
    return scaler._scale.double().reciprocal().float()


@contextlib.contextmanager
def answered_by(scaler: Optional[Any], unscale: Unscale) -> Iterator[None]:
    """For one optimizer step: the scaler's `unscale_` asks `unscale` before touching `.grad`."""
    if scaler is None:
        yield
        return
    torch_unscale = scaler._unscale_grads_

    def unscale_grads(
        optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        found = unscale(optimizer, inv_scale)
        if found is None:
            return torch_unscale(optimizer, inv_scale, found_inf, allow_fp16)
        return {found.device: found}

    scaler._unscale_grads_ = unscale_grads
    try:
        yield
    finally:
        del scaler._unscale_grads_


def non_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """1.0 where any of `tensors` holds an inf or a NaN, else 0.0 (float32, one element)."""
    flag = torch.zeros((), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        if t.numel():
            flag = torch.maximum(flag, (~torch.isfinite(t)).any().to(torch.float32).to(flag.device))
    return flag


def unscale_in_place(tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply `tensors` by `inv_scale` in place, as torch's scaler does; returns this rank's found-inf flag."""
    found = torch.zeros((), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
    if tensors:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(found.device))
    return found
