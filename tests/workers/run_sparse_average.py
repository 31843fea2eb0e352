"""`average_sparse` on its own in 3 real gloo processes, against a brute-force reference: every rank's
gradient made dense, summed, divided by 3, and the rows some rank sent (explicit zeros included).

Tables, averaged in one call, each with the same seed on every rank (so every rank can build every rank's
gradient): uncoalesced rows with duplicates; one rank with no gradient; every rank with an empty gradient
(zero rows); no rank with a gradient (None); a 1-D table and rows of 12, 6 and 10 bytes (fp32, bf16,
fp16) between others, so that the packed message's offsets are not multiples of 8 unless aligned. The first
table alone gives the same.

Usage: python run_sparse_average.py OUT_DIR   (writes OUT_DIR/ok when every rank agreed with the reference)
"""

from __future__ import annotations

import sys
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from commsched.comm.link_groups import Links, LinkSpec
from commsched.comm.local_workers import run_workers
from commsched.comm.sparse_average import average_sparse

WORLD, ROWS = 3, 50


def gradient(case: str, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}{rank}{len(shape)}".encode()))
    if case == "none" or (case == "missing" and rank == 1):
        return None
    count = 0 if case == "empty" else int(torch.randint(1, 30, (1,), generator=g))
    rows = torch.randint(0, ROWS, (1, count), generator=g)  # duplicates: an uncoalesced gradient
    values = torch.randn(count, *shape[1:], generator=g).to(dtype)
    return torch.sparse_coo_tensor(rows, values, shape, check_invariants=True)


def reference(case: str, shape: tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
    grads = [gradient(case, rank, shape, dtype) for rank in range(WORLD)]
    if all(grad is None for grad in grads):
        return None
    dense = sum((grad.to_dense() / WORLD).double() for grad in grads if grad is not None)
    touched = sorted({int(r) for grad in grads if grad is not None for r in grad.coalesce().indices()[0]})
    rows = torch.tensor([touched], dtype=torch.int64)
    return torch.sparse_coo_tensor(rows, dense[touched], shape, check_invariants=True).coalesce()


def check(rank: int, out: str) -> None:
    links = Links([LinkSpec("primary", "gloo")], timedelta(seconds=60), None)
    tables = [
        ("rows", (ROWS, 4), torch.float32),
        ("odd", (ROWS,), torch.float32),  # 12 bytes a row: the next table's row numbers must stay aligned
        ("odd", (ROWS, 3), torch.bfloat16),
        ("missing", (ROWS, 5), torch.float16),
        ("empty", (ROWS, 4), torch.float32),
        ("none", (ROWS, 4), torch.float32),
        ("rows", (ROWS, 2), torch.float64),
    ]
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for _, shape, dtype in tables]
    grads = [gradient(case, rank, shape, dtype) for case, shape, dtype in tables]
    averaged = average_sparse(grads, params, links["primary"], "sparse")  # every table in one call
    alone = average_sparse(grads[:1], params[:1], links["primary"], "alone")[0]  # and one on its own
    assert torch.equal(alone.indices(), averaged[0].indices()) and torch.equal(alone.values(), averaged[0].values())
    for (case, shape, dtype), got in zip(tables, averaged):
        expected = reference(case, shape, dtype)
        if expected is None:
            assert got is None, (case, got)
            continue
        assert got is not None and got.is_sparse, (case, got)
        assert torch.equal(got.indices(), expected.indices()), (case, got.indices(), expected.indices())
        assert got.dtype == dtype, (case, got.dtype)
        tolerance = 1e-6 if dtype in (torch.float32, torch.float64) else 2e-2  # a half's sum of three rounds
        assert torch.allclose(got.values().double(), expected.values(), atol=tolerance), (case, got, expected)
    links.destroy()
    if rank == 0:
        Path(out, "ok").write_text("ok")


if __name__ == "__main__":
    run_workers(WORLD, check, sys.argv[1], timeout_s=120)
