"""DDP's average of sparse gradients (an `nn.Embedding(sparse=True)`'s), on any backend.

DDP divides each rank's sparse gradient by the world size and all-reduces it as a sparse tensor, which
gloo does and NCCL does not. Here every rank all-gathers the others' rows instead, and sums rows that
meet: the same gradient on every backend, in the same order on every rank, and only the rows some rank
touched travel. Two collectives for all the sparse parameters of a backward together: the row counts,
then every table's rows and values packed into one message, each table padded to its longest rank
(and to 8 bytes, where the next table's row numbers start).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from commsched.comm.links import Link

NO_GRADIENT = -1
"""A rank's row count when it produced no gradient at all (an unused embedding), as opposed to zero rows."""


def average_sparse(
    grads: Sequence[Optional[torch.Tensor]], params: Sequence[nn.Parameter], link: Link, tag: str
) -> list[Optional[torch.Tensor]]:
    """Every rank's `grads[i]` (a sparse COO gradient of `params[i]`, rows along the first dimension, or
    None) averaged: rows summed where they meet, divided by the world size. None where no rank produced a
    gradient (the optimizer then skips the parameter, as under DDP). Collective: every rank calls it with
    the same parameters in the same order."""
    coalesced = [grad.coalesce() if grad is not None else None for grad in grads]
    counts = _row_counts(coalesced, link, tag)  # [world, tables]
    rows = [max(int(counts[:, t].max()), 1) for t in range(len(params))]
    widths = [p[0].numel() if p.dim() > 1 else 1 for p in params]
    sizes = [-(-r * (8 + w * p.element_size()) // 8) * 8 for r, w, p in zip(rows, widths, params)]  # 8-aligned
    mine = torch.zeros(sum(sizes), dtype=torch.uint8, device=link.device)
    for grad, part, r, w, p in zip(coalesced, mine.split(sizes), rows, widths, params):
        if grad is not None and grad._nnz():
            indices, values = part[: 8 * r], part[8 * r : 8 * r + r * w * p.element_size()]
            n = grad._nnz()
            indices.view(torch.int64)[:n] = grad.indices()[0].to(link.device)
            values.view(p.dtype)[: n * w] = grad.values().reshape(-1).to(link.device, p.dtype) / link.world_size
    everyone = torch.empty(link.world_size * mine.numel(), dtype=torch.uint8, device=link.device)
    link.all_gather(everyone, mine, tag).wait()
    return [
        _summed(everyone, counts[:, t], sum(sizes[:t]), sum(sizes), rows[t], params[t], link.device)
        for t in range(len(params))
    ]


def _row_counts(grads: Sequence[Optional[torch.Tensor]], link: Link, tag: str) -> torch.Tensor:
    mine = link.tensor([g._nnz() if g is not None else NO_GRADIENT for g in grads], torch.int64)
    everyone = torch.empty(link.world_size * len(grads), dtype=torch.int64, device=link.device)
    link.all_gather(everyone, mine, f"{tag}-rows").wait()
    return everyone.view(link.world_size, len(grads)).cpu()


def _summed(
    everyone: torch.Tensor,
    counts: torch.Tensor,
    offset: int,
    stride: int,
    rows: int,
    param: nn.Parameter,
    device: torch.device,
) -> Optional[torch.Tensor]:
    """One table's rows from every rank's message (`offset` into each rank's `stride` bytes), summed."""
    if int(counts.max()) == NO_GRADIENT:
        return None
    width = param[0].numel() if param.dim() > 1 else 1
    per_rank = everyone.view(-1, stride)[:, offset : offset + rows * (8 + width * param.element_size())]
    indices = per_rank[:, : 8 * rows].contiguous().view(torch.int64)  # [world, rows]
    values = per_rank[:, 8 * rows :].contiguous().view(param.dtype).view(-1, rows, *param.shape[1:])
    sent = counts.clamp(min=0).to(device)
    keep = torch.arange(rows, device=device).unsqueeze(0) < sent.unsqueeze(1)  # each rank's padding off
    summed = torch.sparse_coo_tensor(
        indices[keep].unsqueeze(0),
        values[keep],
        param.shape,
        device=device,
        check_invariants=False,  # rows within the parameter's, from every rank's coalesced gradient
    )
    return summed.coalesce().to(param.device)
