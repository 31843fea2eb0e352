"""`compression="auto"` (what ``strategy="topk"`` runs): top-k exchanges that never lose to dense ones.

Two choices a user should not have to make, each made from measurements on the run's machine:

- the selection: torch.topk or MSTopK, timed once on a tensor the size of the largest bucket (up
  to `SELECTION_PROBE_MAX` elements); rank 0's measurement decides for every rank. MSTopK stays
  available by name (``method="mstopk"``) to reproduce the paper;
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

from commsched.interleaved import DriftWatch, Turns, Verdict, decide, slowest_rank
from commsched.options import CompressionOptions
from commsched.reducers.topk import selector

SELECTION_PROBE_MAX = 2**22
"""Elements the selection probe times at most (both selections cost about linearly in the size)."""
WARMUP_STEPS = 5
"""Steps before the comparison starts (a run's first steps are slow and would favour whichever runs later)."""
DENSE, SPARSE = 0, 1


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


def fastest_selection(numel: int, density: float, samplings: int, device: torch.device, control: Any) -> tuple[str, dict[str, float]]:
    """"topk" or "mstopk", whichever rank 0 measured faster (ties to torch.topk), and the times in ms."""
    mine = None
    if control.rank == 0:
        n = max(1, min(numel, SELECTION_PROBE_MAX))
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        k = max(1, int(density * n))
        mine = {method: _seconds(selector(method, samplings), x, k) * 1e3 for method in ("topk", "mstopk")}
    times = control.broadcast_object(mine, 0, "selection-times")
    return ("mstopk" if times["mstopk"] < times["topk"] else "topk"), times


class SparseOrDense:
    """Whether a sparse exchange runs, decided on real steps; the schedule calls `at_boundary` at every
    iteration start on every rank and sets its reducers dense or sparse as told."""

    def __init__(self, options: CompressionOptions) -> None:
        self.options = options
        self.dense = False
        self.verdict: Optional[Verdict] = None
        self._warming = 0
        self._turns: Optional[Turns] = None
        self._drift: Optional[DriftWatch] = None

    @property
    def deciding(self) -> bool:
        return self.verdict is None

    def at_boundary(self, control: Any, say: Callable[[str], None]) -> Optional[bool]:
        """True / False: exchange dense / sparse from this iteration on; None: as before."""
        if self.verdict is not None:
            if self._drift is None or not self._drift.at_boundary(control):
                return None
            say("commsched topk: steps have become more than "
                f"{self.options.drift:.0%} slower than when sparse and dense were compared: comparing them again")
            self.verdict, self._drift, self._warming = None, None, WARMUP_STEPS
        if self._warming < WARMUP_STEPS:
            self._warming += 1
            return None
        if self._turns is None:
            self._turns = Turns(arms=2, steps_per_turn=self.options.confirm_steps, rounds=self.options.confirm_rounds)
        arm = self._turns.at_boundary()
        if arm is not None:
            return self._set(arm == DENSE)
        if not self._turns.done:
            return None
        self.verdict = decide(slowest_rank(self._turns.samples(), control), self._turns.steps)
        self._turns = None
        self._drift = DriftWatch(self.verdict.medians_s[self.verdict.keep], self.options.drift, self.options.drift_steps)
        dense_ms, sparse_ms = (s * 1e3 for s in self.verdict.medians_s)
        if self.verdict.keep == SPARSE:
            say(f"commsched topk: sparse exchanges measured {sparse_ms:.1f} ms/step against {dense_ms:.1f} dense "
                f"({self.verdict.gain:.2f}x, noise margin {self.verdict.margin:.0%}): kept")
        else:
            say(f"commsched topk: sparse exchanges measured {sparse_ms:.1f} ms/step against {dense_ms:.1f} dense "
                f"(noise margin {self.verdict.margin:.0%}): they do not pay here, the dense all-reduce runs "
                "(compared again if the steps drift)")
        return self._set(self.verdict.keep == DENSE)

    def _set(self, dense: bool) -> Optional[bool]:
        if dense == self.dense:
            return None
        self.dense = dense
        return dense

    def describe(self) -> str:
        if self.verdict is None:
            return "sparse or dense: still comparing"
        dense_ms, sparse_ms = (s * 1e3 for s in self.verdict.medians_s)
        kept = "sparse" if self.verdict.keep == SPARSE else "dense (sparse did not pay)"
        return f"{kept}: sparse {sparse_ms:.1f} ms/step, dense {dense_ms:.1f}"
