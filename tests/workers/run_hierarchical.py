"""wfbp with two-level exchanges on a real multi-node run, for the reference in test_compression.py.

Usage (every node runs it, e.g. under commsched-cluster):
python run_hierarchical.py OUT_DIR NUM_NODES DEVICES CASE [CASE ...]

run_deft's MLP and data, one bucket. Every global rank writes OUT_DIR/<case>.rank<r>.pt: initial
and final weights, its residuals, the bucket's parameter order and padded size, the collective trace.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

import commsched
from commsched.timing import StepTimer
from run_deft import MLP, SEED

warnings.filterwarnings("ignore", ".*does not have many workers.*")

STEPS = 10


def plain(**options) -> commsched.CompressionOptions:
    """Error feedback alone (test_compression's hierarchical_reference): no DGC correction, no density warm-up."""
    return commsched.CompressionOptions(
        momentum_correction=False, decay_before_accumulation=False, sparsity_warmup_steps=0, **options
    )


CASES = {
    "flat-dense": None,
    "hier-dense": commsched.CompressionOptions(method="none", hierarchical=True),
    "hier-topk": plain(method="topk", density=0.1),  # hierarchical by default on 2 nodes
    "hier-mstopk": plain(method="mstopk", density=0.1),
    "hier-topk-phases": plain(method="topk", density=0.1, dense_warmup_steps=2, dense_final_steps=3),
    # DGC's corrections under run_deft's "sgd-groups", with masking (on the shard), the density's warm-up
    # 1 (steps 0-1), 0.25 (2-3), 0.1
    "hier-dgc": commsched.CompressionOptions(
        method="topk", density=0.1, sparsity_warmup_steps=4, momentum_masking=True
    ),
    "hier-dense-streams": commsched.CompressionOptions(method="none", hierarchical=True),
    "auto-two-level": None,  # dense: the stream search tries flat and node first
}
STREAMS = {
    "hier-dense-streams": {"streams": commsched.StreamOptions(count=2, unit_mb=256 / 2**20)},
    "auto-two-level": {
        "streams": commsched.StreamOptions(
            count="auto",
            unit_mb=256 / 2**20,
            min_unit_mb=256 / 2**20,
            max_unit_mb=1024 / 2**20,
            max_streams=3,
            trial_steps=2,
            budget_steps=8,
            warmup_steps=1,
        ),
    },
}


def fit(out: Path, name: str, nodes: int, devices: int) -> None:
    pl.seed_everything(SEED, verbose=False)
    optimizer = "sgd-groups" if name == "hier-dgc" else "sgd"
    model = MLP(optimizer)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strategy = commsched.WFBPStrategy(
        compression=CASES[name], fusion="fixed", trace_collectives=True, **STREAMS.get(name, {})
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        num_nodes=nodes,
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out / name,
        callbacks=[timer := StepTimer(warmup=0)],
    )
    trainer.fit(model)
    schedule = trainer.strategy.last_schedule
    bucket = schedule.plan.buckets[0]
    torch.save(
        {
            "initial": initial,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "residuals": {n: t for r in schedule.reducers for n, t in r.state_dict().get("residual", {}).items()},
            "velocities": {n: t for r in schedule.reducers for n, t in r.state_dict().get("momentum", {}).items()},
            "optimizer": optimizer,
            "clip": None,
            "wire_bytes": timer.wire_bytes,
            "local_bytes": timer.local_bytes,
            "layout": (list(bucket.names), bucket.buffer.numel(), len(schedule.plan.buckets)),
            "trace": [tuple(vars(r).values()) for r in trainer.strategy.collective_trace],
            "steps": STEPS,
            "world": trainer.world_size,
            "nodes": nodes,
            "seed": SEED,
            "compression": vars(CASES[name]) if CASES[name] is not None else None,
            "trials": schedule.streams.trials if schedule.streams is not None else [],
            "chosen": schedule.streams.chosen.to_json()
            if schedule.streams is not None and schedule.streams.chosen
            else None,
        },
        out / f"{name}.rank{trainer.global_rank}.pt",
    )
    if trainer.global_rank == 0:
        print(f"run_hierarchical: {name} done, world size {trainer.world_size}", flush=True)


if __name__ == "__main__":
    out_dir, num_nodes, per_node = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[4:]:
        fit(out_dir, case, num_nodes, per_node)
