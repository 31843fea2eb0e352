"""wfbp runs with sparse exchanges, for the single-process reference in test_compression.py.

Usage: python run_compression.py OUT_DIR WORLD_SIZE CASE [CASE ...]

The model and data are run_deft's (a small MLP on fixed data without shuffling, one bucket), so the
test can recompute every rank's gradient of every step in one process. Each rank writes
OUT_DIR/<case>.rank<r>.pt: initial and final weights, the collective trace, its residuals.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

import commsched
from run_deft import MLP, SEED

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*Checkpoint directory.*exists.*")


def plain(**options) -> commsched.CompressionOptions:
    """Error feedback alone (the reference in test_compression.py): no DGC correction, no density warm-up."""
    return commsched.CompressionOptions(
        momentum_correction=False, decay_before_accumulation=False, sparsity_warmup_steps=0, **options
    )


CASES = {
    # name: (compression, steps, resume_from)
    "topk": (plain(method="topk", density=0.1), 12, None),
    "topk-part": (plain(method="topk", density=0.1), 5, None),
    "topk-resumed": (plain(method="topk", density=0.1), 12, "topk-part"),
    "topk-no-feedback": (plain(method="topk", density=0.1, error_feedback=False), 12, None),
    "mstopk": (plain(method="mstopk", density=0.05), 12, None),
    "topk-dense-phases": (plain(method="topk", density=0.1, dense_warmup_steps=3, dense_final_steps=3), 12, None),
    "mstopk-whole": (plain(method="mstopk", density=1.0), 12, None),
    "topk-every-element": (plain(method="topk", density=0.1, whole_vectors=False), 12, None),
    # strategy="topk"'s default: the faster selection, sparse and dense taking turns after 5 steps (2 rounds
    # of 1 + 1 steps each), then the faster kept
    "topk-auto": (plain(method="auto", density=0.1, confirm_steps=1, confirm_rounds=2, confirm_max_rounds=2), 16, None),
    "dense": (None, 12, None),
    "dense-from-topk": (None, 12, "topk-part"),  # a dense run takes the residuals into its first step
    # run by three processes: resumes the 2-process checkpoint (no step taken), its residuals re-sharded
    "topk-resharded": (plain(method="topk", density=0.1), 5, "topk-part"),
    # DGC's corrections (the defaults) under SGD with two param groups: test_compression's dgc_reference
    "dgc": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 12, None),
    "dgc-part": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 5, None),
    "dgc-resumed": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 12, "dgc-part"),
    "dgc-nesterov": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 12, None),
    "dgc-clipped": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 12, None),
    "dgc-masked": (
        commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0, momentum_masking=True),
        12,
        None,
    ),
    # the density's warm-up: 1 for steps 0-3, 0.25 for 4-7, then 0.1 (sampled threshold: the same elements as
    # torch.topk)
    "dgc-warmup": (commsched.CompressionOptions(method="sampled", density=0.1, sparsity_warmup_steps=8), 12, None),
    "dgc-resharded": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 5, "dgc-part"),
    "dense-from-dgc": (None, 12, "dgc-part"),  # velocities a dense run cannot take: refused, not dropped
    # AdamW: the corrections stand in for nothing, so the defaults are error feedback alone, clipping Lightning's
    "adamw-default": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 12, None),
    "adamw-plain": (plain(method="topk", density=0.1), 12, None),
    # fp16 with a GradScaler (DGC's corrections: residuals and velocities): every step overflows, or the first few
    "fp16-all-skipped": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 3, None),
    "fp16-some-skipped": (commsched.CompressionOptions(method="topk", density=0.1, sparsity_warmup_steps=0), 12, None),
}
FIRST_SCALE = {"fp16-all-skipped": 2.0**40, "fp16-some-skipped": 2.0**22}  # fp16 autocast, torch's GradScaler
OPTIMIZER = {
    "dgc-nesterov": "sgd-nesterov",
    "dgc-part": "sgd-groups",
    "dense-from-dgc": "sgd-groups",
    "adamw-default": "adamw",
    "adamw-plain": "adamw",
}
CLIP = {"dgc-clipped": 0.05, "adamw-default": 0.05, "adamw-plain": 0.05}  # Trainer(gradient_clip_val=...)


def fit(out: Path, name: str, world: int) -> None:
    compression, steps, resume_from = CASES[name]
    pl.seed_everything(SEED, verbose=False)
    optimizer = OPTIMIZER.get(name, "sgd-groups" if name.startswith("dgc") else "sgd")
    model = MLP(optimizer)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    strategy = commsched.WFBPStrategy(compression=compression, fusion="fixed", trace_collectives=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        gradient_clip_val=CLIP.get(name),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=FIRST_SCALE[name]))]
        if name in FIRST_SCALE
        else None,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out / name,
        callbacks=[ModelCheckpoint(dirpath=out / f"{name}-ckpt", every_n_train_steps=1, save_top_k=-1)],
    )
    ckpt = str(out / f"{resume_from}-ckpt" / f"epoch=0-step={CASES[resume_from][1]}.ckpt") if resume_from else None
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except commsched.CommSchedConfigError as error:
        torch.save({"refused": str(error)}, out / f"{name}.rank{trainer.global_rank}.pt")
        return
    schedule = trainer.strategy.last_schedule
    residuals = {
        name: tensor
        for reducer in schedule.reducers
        for name, tensor in reducer.state_dict().get("residual", {}).items()
    }
    velocities = {
        name: tensor
        for reducer in schedule.reducers
        for name, tensor in reducer.state_dict().get("momentum", {}).items()
    }
    result = {
        "initial": initial,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "trace": [tuple(vars(r).values()) for r in trainer.strategy.collective_trace],
        "residuals": residuals,
        "velocities": velocities,
        "optimizer": optimizer,
        "clip": CLIP.get(name),
        "param_groups": [
            {k: v for k, v in group.items() if k != "params"} for group in trainer.optimizers[0].param_groups
        ],
        "steps": steps,
        "world": world,
        "seed": SEED,
        "compression": vars(compression) if compression is not None else None,
        "selection": dict(schedule.settings.selection),
        "kept": schedule.settings.sparse_or_dense.verdict.keep if schedule.settings.sparse_or_dense else None,
        "scale": trainer.precision_plugin.scaler.get_scale() if name in FIRST_SCALE else None,
    }
    torch.save(result, out / f"{name}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out_dir, world_size = Path(sys.argv[1]), int(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[3:]:
        fit(out_dir, case, world_size)
