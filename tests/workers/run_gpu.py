"""The GPU path in real runs: every schedule and planner on CUDA, against Lightning's ddp on the same
devices, and the profiler's figures against a synchronised wall-clock measurement.

Usage: python run_gpu.py OUT_DIR WORLD_SIZE CASE [CASE ...]   (needs WORLD_SIZE CUDA devices: NCCL)

Started once per rank with `COMMSCHED_TEST_SHARED_GPU=1` (and `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`),
each rank is a node of its own with one device: every rank computes on `cuda:0` and the ranks talk over gloo, since NCCL
refuses two ranks on one GPU (tests/gpu/test_two_ranks.py). `COMMSCHED_TEST_ACCELERATOR=cpu` runs the
same cases on the CPU (the harness, on a machine without a GPU).

Every rank writes OUT_DIR/<case>.rank<r>.pt (final state, trace, profile where asked); the
"clock" case times each bucket's all-reduce with a device synchronize around it, independently
of the profiler, and saves the bucket sizes and seconds.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

import commsched
from commsched.comm.device_time import synchronize

sys.path.insert(0, str(Path(__file__).parent))
from toy import ToyNet  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")

ACCELERATOR = os.environ.get("COMMSCHED_TEST_ACCELERATOR", "gpu")
SHARED = os.environ.get("COMMSCHED_TEST_SHARED_GPU") == "1"  # not NODE_RANK: Lightning sets it in its children
"""Every rank a node of its own on the one device, over gloo (else: WORLD_SIZE devices, NCCL)."""
BUCKET_MB = 600 / 2**20
NO_DELAY = commsched.DeFTOptions(capacity=None, warmup_steps=1, measure_steps=2, cost_repeats=1)


def every_element(method: str) -> commsched.CompressionOptions:
    """A sparse exchange that sends everything, with error feedback alone."""
    return commsched.CompressionOptions(
        method=method, density=1.0, momentum_correction=False, decay_before_accumulation=False, sparsity_warmup_steps=0
    )


CASES = {
    "ddp": lambda **common: DDPStrategy(**common, find_unused_parameters=True),
    "wfbp": lambda **common: commsched.WFBPStrategy(**common, bucket_cap_mb=BUCKET_MB, trace_collectives=True),
    "dear": lambda **common: commsched.DeARStrategy(
        **common, bucket_cap_mb=BUCKET_MB, trace_collectives=True, dear=commsched.DeAROptions(fallback="never")
    ),
    "deft": lambda **common: commsched.DeFTStrategy(
        **common, bucket_cap_mb=BUCKET_MB, deft=NO_DELAY, trace_collectives=True
    ),
    "deft-plan": lambda **common: commsched.DeFTStrategy(
        **common,
        bucket_cap_mb=BUCKET_MB,
        trace_collectives=True,
        deft=commsched.DeFTOptions(capacity=None, warmup_steps=1, measure_steps=2, cost_repeats=1, fallback="never"),
    ),
    "dear-profiled": lambda **common: commsched.DeARStrategy(
        **common, bucket_cap_mb=BUCKET_MB, profile=commsched.ProfileOptions(steps=6, probe=True)
    ),
    "dear-mgwfbp": lambda **common: commsched.DeARStrategy(
        **common,
        bucket_cap_mb=BUCKET_MB,
        fusion=commsched.FusionOptions(policy="mgwfbp", profile_steps=2, profile_warmup_steps=1),
    ),
    "wfbp-dear-model": lambda **common: commsched.WFBPStrategy(
        **common,
        bucket_cap_mb=BUCKET_MB,
        fusion=commsched.FusionOptions(policy="dear-model", profile_steps=2, profile_warmup_steps=1),
    ),
    "dear-bayes": lambda **common: commsched.DeARStrategy(
        **common,
        fusion="bayes",
        tuning=commsched.TuningOptions(
            trials=2, trial_steps=2, warmup_steps=1, min_mb=200 / 2**20, max_mb=2000 / 2**20, first_mb=600 / 2**20
        ),
    ),
    # sparse exchanges on the device: at density 1 with error feedback alone (DGC's corrections move the
    # momentum, the decay and the clipping into the exchange: another trajectory) they must equal ddp;
    # at 0.1 the residuals stay on the rank's device
    "topk-whole": lambda **common: commsched.WFBPStrategy(**common, compression=every_element("topk")),
    "mstopk-whole": lambda **common: commsched.WFBPStrategy(**common, compression=every_element("mstopk")),
    "topk-sparse": lambda **common: commsched.WFBPStrategy(
        **common, compression=commsched.CompressionOptions(method="topk", density=0.1)
    ),
    # several NCCL communicators, each on its own CUDA stream; and the search switching between them
    "wfbp-streams": lambda **common: commsched.WFBPStrategy(
        **common,
        bucket_cap_mb=BUCKET_MB,
        streams=commsched.StreamOptions(count=4, unit_mb=160 / 2**20),
        trace_collectives=True,
    ),
    "dear-streams": lambda **common: commsched.DeARStrategy(
        **common,
        bucket_cap_mb=BUCKET_MB,
        streams=commsched.StreamOptions(count=3, unit_mb=160 / 2**20),
        trace_collectives=True,
    ),
    "dear-streams2": lambda **common: commsched.DeARStrategy(
        **common, bucket_cap_mb=BUCKET_MB, streams=commsched.StreamOptions(count=2), trace_collectives=True
    ),
    "dear-streams-auto": lambda **common: commsched.DeARStrategy(
        **common,
        bucket_cap_mb=BUCKET_MB,
        trace_collectives=True,
        streams=commsched.StreamOptions(
            count="auto",
            unit_mb=160 / 2**20,
            min_unit_mb=160 / 2**20,
            max_unit_mb=640 / 2**20,
            max_streams=4,
            trial_steps=2,
            budget_steps=8,
            warmup_steps=1,
        ),
    ),
}
STEPS = 12


def fit(out: Path, case: str, world: int) -> None:
    pl.seed_everything(1234, verbose=False)
    model = ToyNet(optimizer="adamw" if case.endswith("adamw") else "sgd", batch_size=4, train_size=STEPS * 4 * world)
    common = {"process_group_backend": "gloo"} if SHARED else {}
    strategy = CASES[case.removesuffix("-adamw")](**common)  # "<case>-adamw": the same strategy, under AdamW
    trainer = pl.Trainer(
        accelerator=ACCELERATOR,
        devices=1 if SHARED else world,
        num_nodes=world if SHARED else 1,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        gradient_clip_val=0.5,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out / case,
    )
    trainer.fit(model)
    result = {
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "trace": [tuple(vars(r).values()) for r in getattr(trainer.strategy, "collective_trace", [])],
        "profile": getattr(trainer.strategy, "profile", None),
        "residual_devices": residual_devices(trainer),
        "optimizer": type(trainer.optimizers[0]).__name__,
    }
    torch.save(result, out / f"{case}.rank{trainer.global_rank}.pt")
    if case == "dear-profiled":
        clock(out, trainer, result["profile"])


def residual_devices(trainer: pl.Trainer) -> list[str]:
    """Where each sparse reducer keeps its error-feedback residuals (empty for dense exchanges)."""
    schedule = getattr(trainer.strategy, "last_schedule", None)
    reducers = getattr(schedule, "reducers", []) if schedule is not None else []
    return [str(tensor.device) for reducer in reducers for tensor in reducer.state_dict().get("residual", {}).values()]


def clock(out: Path, trainer: pl.Trainer, profile: dict) -> None:
    """Each profiled bucket's all-reduce, timed here with a synchronize before and after (no futures), on
    the device the link's collectives touch (the GPU for NCCL; host memory for gloo, which the engine
    stages a CUDA bucket into)."""
    device = trainer.strategy.root_device
    linked = device if dist.get_backend() == "nccl" else torch.device("cpu")
    measured = []
    for bucket in profile["buckets"]:
        tensor = torch.zeros(max(1, bucket["nbytes"] // 4), device=linked)
        times = []
        for _ in range(16):
            dist.barrier()  # both ranks start together: the time is the collective's, not the other's arrival
            synchronize(device)
            started = time.perf_counter()
            dist.all_reduce(tensor)
            synchronize(device)
            times.append(time.perf_counter() - started)
        measured.append(statistics.median(times[1:]))
    torch.save(
        {"profiled": [b["all_reduce_s"] for b in profile["buckets"]], "clock": measured},
        out / f"clock.rank{trainer.global_rank}.pt",
    )


def main() -> None:
    out, world, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        fit(out, case, world)


if __name__ == "__main__":
    main()
