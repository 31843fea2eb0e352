"""DDP's average of a sparse gradient (an `nn.Embedding(sparse=True)`'s), on any backend.

DDP divides each rank's sparse gradient by the world size and all-reduces it as a sparse tensor, which
gloo does and NCCL does not. Here every rank all-gathers the others' rows instead (their counts first,
then indices and values padded to the longest), and sums rows that meet: the same gradient on every
backend, in the same order on every rank, and only the rows some rank touched travel.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from commsched.comm.links import Link

NO_GRADIENT = -1
"""A rank's row count when it produced no gradient at all (an unused embedding), as opposed to zero rows."""


def average_sparse(grad: Optional[torch.Tensor], param: nn.Parameter, link: Link, tag: str) -> Optional[torch.Tensor]:
    """Every rank's `grad` (a sparse COO gradient of `param`, or None) averaged: rows summed where they
    meet, divided by the world size. None where no rank produced a gradient (the optimizer then skips
    `param`, as under DDP). Collective: every rank calls it for the same parameters in the same order."""
    world = link.world_size
    if grad is not None:
        grad = grad.coalesce()
    counts = link.all_gather_int(grad._nnz() if grad is not None else NO_GRADIENT, f"{tag}-rows")
    if max(counts) == NO_GRADIENT:
        return None
    rows = max(max(counts), 1)
    width = param[0].numel() if param.dim() > 1 else 1
    indices = torch.zeros(rows, dtype=torch.int64, device=link.device)
    values = torch.zeros(rows * width, dtype=param.dtype, device=link.device)
    if grad is not None and grad._nnz():
        indices[: grad._nnz()] = grad.indices()[0].to(link.device)
        values[: grad._nnz() * width] = grad.values().reshape(-1).to(link.device) / world
    all_indices = torch.empty(world * rows, dtype=torch.int64, device=link.device)
    all_values = torch.empty(world * rows * width, dtype=param.dtype, device=link.device)
    gathered = [link.all_gather(all_indices, indices, f"{tag}-indices"), link.all_gather(all_values, values, tag)]
    for pending in gathered:
        pending.wait()
    sent = torch.tensor([max(count, 0) for count in counts], device=link.device)
    keep = (torch.arange(rows, device=link.device).unsqueeze(0) < sent.unsqueeze(1)).reshape(-1)  # padding off
    summed = torch.sparse_coo_tensor(
        all_indices[keep].unsqueeze(0),
        all_values.view(world * rows, *param.shape[1:])[keep],
        param.shape,
        device=link.device,
        check_invariants=False,  # rows within the parameter's, from every rank's coalesced gradient
    )
    return summed.coalesce().to(param.device)
