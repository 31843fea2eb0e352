"""Lightning's own callbacks under ddp, wfbp and dear; save what each run ended with.

Usage: python run_callbacks.py OUT_DIR WORLD_SIZE CASE [CASE ...]   (a case: ARCH-CALLBACK-STRATEGY)

Every rank writes OUT_DIR/<case>.rank<r>.pt with the final weights and buffers, the optimizer's
state by parameter name, what the module's own `on_train_batch_end` read, and (EMA) the average model.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

import commsched

sys.path.insert(0, str(Path(__file__).parent))
from callback_models import Classifier, WeightReader  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*Checkpoint directory.*exists.*")
warnings.filterwarnings("ignore", ".*SWA.*")

EPOCHS = 4
SAMPLES_PER_RANK = 24  # 6 steps of 4 per epoch


def callbacks_for(name: str, out: Path, case: str) -> list[pl.Callback]:
    if name == "ema":
        return [EMAWeightAveraging(decay=0.8)]
    if name in ("swa", "swareader"):
        return [StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2)]
    if name == "pruning":
        return [ModelPruning("l1_unstructured", amount=0.3, apply_pruning=lambda epoch: epoch in (0, 1), verbose=0)]
    if name == "finetune":
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)]
    if name == "early":  # stops at the first validation that fails to improve by 10 (every one)
        return [EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)]
    if name == "accum":  # 1, then 2, then 3 micro-batches a step
        return [GradientAccumulationScheduler({0: 1, 1: 2, 2: 3})]
    if name == "lrfind":  # a learning-rate sweep on the first steps, the weights restored after it
        return [LearningRateFinder(min_lr=1e-3, max_lr=0.1, num_training_steps=16, early_stop_threshold=None)]
    if name == "lrmon":
        return [LearningRateMonitor(logging_interval="step")]
    if name.startswith("ckpt"):  # ckpt<N>: a checkpoint every N steps
        return [ModelCheckpoint(dirpath=out / f"{case}-ckpt", every_n_train_steps=int(name[4:]), save_top_k=-1)]
    if name in ("reader", "plain"):
        return []
    raise ValueError(name)


def strategy_for(kind: str):
    if kind == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    if kind == "deft":  # room for everything: DDP's updates over two links
        return commsched.DeFTStrategy(
            bucket_cap_mb=2000 / 2**20,
            deft=commsched.DeFTOptions(capacity=None, warmup_steps=1, measure_steps=1, cost_repeats=1),
        )
    if kind == "dear":  # DeAR itself throughout (its overlap under callbacks is what is tested), never WFBP
        return commsched.DeARStrategy(bucket_cap_mb=2000 / 2**20, dear=commsched.DeAROptions(fallback="never"))
    return commsched.WFBPStrategy(bucket_cap_mb=2000 / 2**20)  # several buckets even on these tiny models


def optimizer_state_by_name(model: pl.LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        f"{names[id(p)]}.{k}": v.detach().clone()
        for p, state in optimizer.state.items()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    }


def run(out: Path, case: str, world: int) -> None:
    arch, callback, kind = case.split("-")
    pl.seed_everything(7, verbose=False)
    model_class = WeightReader if callback.endswith("reader") else Classifier
    model = model_class(arch, samples=SAMPLES_PER_RANK * world, lr_schedule=callback != "finetune")
    callbacks = callbacks_for(callback, out, case)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy_for(kind),
        max_epochs=EPOCHS,
        limit_val_batches=1,
        val_check_interval=0.5,
        num_sanity_val_steps=0,
        logger=CSVLogger(out / case) if callback == "lrmon" else False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=callback.startswith("ckpt"),
        callbacks=callbacks,
        default_root_dir=out / case,
    )
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.fit(model)
    result = {
        "initial": initial,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer_state_by_name(model, trainer.optimizers[0]),
        "weights_seen": model.weights_seen,
        "global_step": trainer.global_step,
        "lr": model.lr,
    }
    for cb in callbacks:
        if isinstance(cb, EMAWeightAveraging) and cb._average_model is not None:
            result["average"] = {k: v.detach().clone() for k, v in cb._average_model.module.state_dict().items()}
    torch.save(result, out / f"{case}.rank{trainer.global_rank}.pt")


def main() -> None:
    out, world, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        run(out, case, world)


if __name__ == "__main__":
    main()
