"""Optimizers from the packages users bring, under each schedule, for test_user_optimizers.py.

Usage: python run_user_optimizers.py OUT_DIR CASE [CASE ...]   (a case: SCHEDULE-OPTIMIZER)

SCHEDULE: ddp, wfbp, dear, deft, streams (wfbp on 2 streams), topk (at a density that sends everything).
OPTIMIZER: prodigy (prodigyopt), dadapt (dadaptation's DAdaptAdam),
schedulefree (schedulefree's SGDScheduleFree, with `train()`/`eval()` called from the LightningModule's
hooks as its README shows, a validation every 5 steps), lion (lion-pytorch), hooks2 and hooks3 (torch's
SGD with two or three of torch's global step pre-hooks that read a weight).

Every rank writes OUT_DIR/<case>.rank<r>.pt: the final weights and buffers, and for the hook cases
what each hook read, in order.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

import commsched

warnings.filterwarnings("ignore")
STEPS = 10
TINY_BUCKETS_MB = 0.0004  # a bucket or two per layer: DeAR applies the update in several parts


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, lr=1.0, weight_decay=0.01)
    if name == "dadapt":
        from dadaptation import DAdaptAdam

        return DAdaptAdam(params, lr=1.0, weight_decay=0.01)
    if name == "schedulefree":
        from schedulefree import SGDScheduleFree

        return SGDScheduleFree(params, lr=0.05, warmup_steps=3, weight_decay=1e-3)
    if name == "lion":
        from lion_pytorch import Lion

        return Lion(params, lr=1e-3, weight_decay=0.01)
    if name.startswith("hooks"):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    raise ValueError(name)


class Net(pl.LightningModule):
    """A small MLP with BatchNorm."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.parameters())

    # schedule-free's README: the optimizer is in train mode while training, in eval mode otherwise
    def _mode(self, mode: str) -> None:
        if self.optimizer_name == "schedulefree":
            getattr(self.optimizers().optimizer, mode)()

    def on_train_epoch_start(self) -> None:
        self._mode("train")

    def on_validation_epoch_start(self) -> None:
        self._mode("eval")

    def on_validation_epoch_end(self) -> None:
        self._mode("train")

    def on_train_end(self) -> None:
        self._mode("eval")


def strategy_for(schedule: str):
    if schedule == "ddp":
        return DDPStrategy()
    if schedule == "dear":  # DeAR on every step (no turns with WFBP), several buckets
        return commsched.DeARStrategy(bucket_cap_mb=TINY_BUCKETS_MB, dear=commsched.DeAROptions(fallback="never"))
    if schedule == "wfbp":
        return commsched.WFBPStrategy(bucket_cap_mb=TINY_BUCKETS_MB)
    if schedule == "streams":
        return commsched.WFBPStrategy(bucket_cap_mb=TINY_BUCKETS_MB, streams=commsched.StreamOptions(count=2))
    if schedule == "topk":  # density 1/2 on 2 processes sends everything: exact, with DGC's corrections under SGD
        return commsched.WFBPStrategy(
            bucket_cap_mb=TINY_BUCKETS_MB,
            compression=commsched.CompressionOptions(method="topk", density=0.5, sparsity_warmup_steps=0),
        )
    if schedule == "deft":
        return commsched.DeFTStrategy(
            bucket_cap_mb=TINY_BUCKETS_MB, deft=commsched.DeFTOptions(warmup_steps=1, measure_steps=1, cost_repeats=1)
        )
    raise ValueError(schedule)


def fit(case: str, out: Path) -> None:
    schedule, optimizer = case.split("-", 1)
    pl.seed_everything(5, verbose=False)
    model = Net(optimizer)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(160, 8, generator=g), torch.randint(0, 4, (160,), generator=g))
    reads: list[float] = []
    handles = []
    if optimizer.startswith("hooks"):
        for i in range(int(optimizer[len("hooks") :])):
            layer = model.net[(0, 3, 5)[i]]

            def read(opt, args, kwargs, layer=layer):
                reads.append(float(layer.weight.detach().double().sum()))

            handles.append(register_optimizer_step_pre_hook(read))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_for(schedule),
        max_steps=STEPS,
        val_check_interval=5,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out / f"{case}-run",
    )
    try:
        trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    finally:
        for handle in handles:
            handle.remove()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"state": state, "reads": reads}, out / f"{case}.rank{trainer.global_rank}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[2:]:
        fit(case, out)


if __name__ == "__main__":
    main()
