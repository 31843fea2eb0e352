"""`compression="auto"` (what ``strategy="topk"`` runs): top-k exchanges that never lose to dense ones.

Two choices a user should not have to make, each made from measurements on the run's machine:

- the selection: torch.topk, the sampled threshold or MSTopK, timed once on a tensor the size of
  the largest bucket (up to `SELECTION_PROBE_MAX` elements); rank 0's measurement decides for
  every rank. MSTopK stays available by name (``method="mstopk"``) to reproduce the paper;
- sparse or dense: on a fast link, or when selecting costs more than the bytes it saves, the dense
  all-reduce is faster and loses nothing. After `WARMUP_STEPS` steps both exchanges take turns on
  real steps (`commsched.interleaved`), the slowest rank's step times decide, and sparse is kept
  only when it beats dense by more than the measured noise; the run says which it keeps, and a
  later drift of the step time compares them again. Entering dense, each rank's residual joins
  that step's gradient, so nothing kept back is lost (the dense phases' mechanism).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from commsched.compression.selections import SELECTIONS, selector
from commsched.interleaved import MeasuredChoice
from commsched.options import CompressionOptions

SELECTION_PROBE_MAX = 2**22
"""Elements the selection probe times at most (both selections cost about linearly in the size)."""
WARMUP_STEPS = 5
"""Steps before the comparison starts (a run's first steps are slow and would favour whichever runs later)."""
DENSE, SPARSE = 0, 1
EXCHANGE_ARMS = ("dense", "sparse")


def _seconds(select: Callable[..., Any], x: torch.Tensor, k: int, repeats: int = 3) -> float:
    select(x, k)  # first call: allocations, kernels
    best = float("inf")
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        select(x, k)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        best = min(best, time.perf_counter() - start)
    return best


def fastest_selection(
    numel: int, density: float, samplings: int, device: torch.device, control: Any
) -> tuple[str, dict[str, float]]:
    """The selection (`SELECTIONS`) rank 0 measured fastest (ties to the earlier: torch.topk first), and the times
    in ms."""
    mine = None
    if control.rank == 0:
        n = max(1, min(numel, SELECTION_PROBE_MAX))
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        k = max(1, int(density * n))
        mine = {method: _seconds(selector(method, samplings), x, k) * 1e3 for method in SELECTIONS}
    times = control.broadcast_object(mine, 0, "selection-times")
    return min(SELECTIONS, key=lambda method: times[method]), times


class SparseOrDense:
    """Whether a sparse exchange runs, decided on real steps; the schedule calls `at_boundary` at every
    iteration start on every rank and sets its reducers dense or sparse as `dense` says."""

    def __init__(self, options: CompressionOptions) -> None:
        self.options = options
        self.choice = MeasuredChoice(
            options.confirm_steps,
            options.confirm_rounds,
            options.drift,
            options.drift_steps,
            WARMUP_STEPS,
            max_rounds=options.confirm_max_rounds,
        )

    @property
    def dense(self) -> bool:
        return self.choice.arm == DENSE

    @property
    def deciding(self) -> bool:
        return self.choice.deciding

    @property
    def verdict(self) -> Any:
        return self.choice.verdict

    def at_boundary(self, control: Any, say: Callable[[str], None]) -> None:
        reopened = self.choice.reopened
        self.choice.at_boundary(control)
        if self.choice.reopened > reopened:
            say(
                "commsched topk: steps have become more than "
                f"{self.options.drift:.0%} slower than when sparse and dense were compared: comparing them again"
            )
        verdict = self.choice.verdict
        if verdict is None or verdict is self._said:
            return
        self._said = verdict
        outcome = "kept" if verdict.keep == SPARSE else "they do not pay here, the dense all-reduce runs"
        say(
            f"commsched topk: {verdict.describe(EXCHANGE_ARMS)}: {outcome} (compared again later in the run "
            "and if the steps drift)"
        )

    _said: Optional[Any] = None

    def describe(self) -> str:
        verdict = self.choice.verdict
        if verdict is None:
            return "sparse or dense: still comparing"
        return f"sparse or dense: {verdict.describe(EXCHANGE_ARMS)}"
