"""Options of sparse exchanges on wfbp (top-k selection, error feedback, DGC's corrections),
and which schedules take them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from commsched.errors import Either, bad_value
from commsched.options.catalogue import COMPRESSION_METHODS
from commsched.options.validators import (
    choice,
    flag,
    is_real,
    non_negative_int,
    non_negative_number,
    one_of,
    option,
    optional,
    positive_int,
    typed,
    warmup_value,
)


def density_value(name: str, value: Any) -> float:
    if not (is_real(value) and 0 < value <= 1):
        raise bad_value(name, value, "a number in (0, 1]")
    return float(value)


@dataclass
class CompressionOptions:
    """Sparse gradient exchanges ([cloud-topk]): each rank sends the `density` share of each bucket's
    elements of largest magnitude; what it did not send is kept and sent later."""

    method: str = option("none", one_of(*COMPRESSION_METHODS))
    """"auto" (``strategy="topk"``): top-k with the selection measured fastest here, kept only while it
    beats the dense all-reduce on real steps; "topk": torch.topk; "sampled": the same elements as
    torch.topk, found from a threshold read in a sample (several times faster on CPUs); "mstopk":
    the paper's threshold search (approximate; no sort, fixed-size outputs); "none": dense all-reduce."""
    density: float = option(0.01, density_value)
    """The share of each bucket's elements a rank sends (0 < density <= 1; at least one element)."""
    hierarchical: Optional[bool] = option(None, optional(flag))
    """Reduce each bucket node first (HiTopKComm; with method "none" the dense two-level all-reduce):
    a reduce-scatter inside each node, the shard combined across nodes among the ranks of the same
    local rank, an all-gather inside the node. None: for sparse methods when the run has more than
    one node (dense runs stay flat unless True)."""
    samplings: int = option(30, positive_int)
    """MSTopK's threshold bisection rounds (the paper's N)."""
    error_feedback: bool = option(True, flag)
    """Keep what a rank did not send (its residual) and add it before the next selection. Without it
    the unsent gradient is lost every step and training converges worse."""
    whole_vectors: bool = option(True, flag)
    """Send every element of one-dimensional parameters (biases, normalisation scales and shifts) in
    each sparse exchange, beside the `density` share selected among the other parameters' elements.
    Ranked with everything else they are starved: on digits ResNet-18 with error feedback scored 1.5
    points lower without this. False: top-k over every element, as the paper does."""
    dense_warmup_steps: int = option(0, non_negative_int)
    """The first optimizer steps exchange dense gradients (early training is the most sensitive)."""
    confirm_steps: int = option(3, positive_int)
    """auto: timed steps per turn when sparse and dense exchanges take turns (one more runs first, untimed)."""
    confirm_rounds: int = option(3, positive_int)
    """auto: turns each exchange takes before the measured steps may overrule the default (steps that agree with it
    decide after two)."""
    confirm_max_rounds: int = option(6, positive_int)
    """auto: turns each exchange may take in all when the steps lean against the model's choice within their
    noise (more turns until the difference is resolved; at least `confirm_rounds`)."""
    drift: float = option(0.2, non_negative_number)
    """auto: a median step this much slower than the kept exchange measured compares them again. 0: never."""
    drift_steps: int = option(50, positive_int)
    """auto: steps per median watched for drift."""
    momentum_correction: bool = option(True, flag)
    """Under torch's SGD with momentum (DGC's momentum correction): each rank keeps its own velocity
    u <- m u + g (Nesterov: u <- m (u + g), and u + g is accumulated), adds it to its residual and
    selects from that; the optimizer then steps with momentum 0, since what it receives has already
    moved with momentum. Without it, a coordinate held back for many steps lands as one large
    gradient that momentum keeps applying. Needs `error_feedback`; other optimizers: error feedback alone."""
    momentum_masking: bool = option(False, flag)
    """With momentum correction: where a rank sent a coordinate, its velocity is cleared as well as its
    residual (DGC's momentum factor masking, against stale momentum). Off by default: without it the
    updates sent add up to exactly what SGD with momentum applies, only later; with it a coordinate
    sent often loses most of its momentum. On digits, 4 ranks, against ddp (3 seeds): ResNet-18 at
    density 0.01 lost 23.5 points with it and 6.1 without (4 epochs), 1.3 and 0.9 (12 epochs, 2
    seeds); the small CNN at 0.001 -4.5 and +0.6."""
    decay_before_accumulation: bool = option(True, flag)
    """Under torch's SGD: the weight decay joins each rank's gradient before accumulation and selection,
    and the optimizer steps with weight decay 0 (decay added to the sparse update after the exchange
    cost PaddlePaddle's DGC 2 points of top-1)."""
    local_clipping: bool = option(True, flag)
    """With Trainer(gradient_clip_val=C) by norm and a correction on: each rank clips each parameter's
    gradient to norm C / sqrt(P) before accumulation (DGC), and the exchanged update is not clipped again."""
    sparsity_warmup_steps: Any = option("auto", warmup_value)
    """The density starts at 1 (dense) and falls fourfold per stage to `density` over this many optimizer
    steps (DGC's exponential warm-up; dense stages and those at more than 1/P exchange densely). "auto":
    a quarter of the run, at most four epochs (none after a `dense_warmup_steps` phase); 0: none."""
    dense_final_steps: int = option(0, non_negative_int)
    """The last optimizer steps of the run (`Trainer.estimated_stepping_batches`) are dense again: the
    paper kept its last epochs dense because top-k cost accuracy there. Entering a dense phase, each
    rank's residual joins that step's gradient, so nothing kept back is lost."""


SPARSE_REFUSED = {
    "dear": (
        "DeAR defers the all-gather half of each bucket's all-reduce; a sparse exchange is one all-gather, "
        "with nothing to defer"
    ),
    "deft": "DeFT's generations add dense gradients over iterations",
}
"""Why a built-in schedule does not take sparse exchanges (one sentence each)."""


def check_compression(compression: Any, schedule: str, compresses: bool) -> None:
    """Sparse and two-level exchanges only on schedules that build them, refused before anything starts
    (torch-free: `commsched-train` checks its input before importing torch)."""
    if compression.hierarchical and not compresses:
        raise bad_value(
            "compression.hierarchical",
            compression.hierarchical,
            f"None or False with schedule {schedule}",
            fix=Either("the two-level exchange runs on WFBPStrategy.", "the two-level exchange runs on schedule=wfbp."),
        )
    if compression.method != "none" and not compresses:
        why = SPARSE_REFUSED.get(schedule, f"schedule {schedule} builds no sparse exchange")
        raise bad_value(
            "compression.method",
            compression.method,
            f"'none' with schedule {schedule} ({why})",
            fix=Either(
                'sparse exchanges run on wfbp: Trainer(strategy="topk"), or '
                f"WFBPStrategy(compression={compression.method!r}).",
                f"sparse exchanges run on wfbp: schedule=wfbp compression={compression.method}.",
            ),
        )


def compression_from(compression: Any) -> CompressionOptions:
    """The strategy's `compression=`: a method name or options (None: dense)."""
    if compression is None:
        return CompressionOptions()
    if isinstance(compression, str):
        return CompressionOptions(method=choice("compression", compression, COMPRESSION_METHODS))
    return typed("compression", compression, CompressionOptions)
