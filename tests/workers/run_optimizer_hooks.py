"""The optimizer's step hooks under each schedule, for test_optimizer_contract.py.

Usage: python run_optimizer_hooks.py OUT_DIR SCHEDULE [SCHEDULE ...]

Each rank writes OUT_DIR/<schedule>.rank<r>.json: every call of a step pre-hook, a step post-hook
and torch's global pre/post hooks, in order, with how many parameters each param group showed, the
sum of the weights the hook read (a hook that reads weights sees them as ddp would) and the momentum
and weight decay the param group showed. ddp and topk also save a checkpoint at the last step
(OUT_DIR/<schedule>-ckpt/).

topk runs DGC's corrections at density 0.5, which on 2 processes sends everything (a dense exchange of
the velocities): exactly SGD with momentum, with the momentum kept outside the optimizer.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset

import commsched

warnings.filterwarnings("ignore")
STEPS = 6


class MLP(pl.LightningModule):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.record("pre", opt))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.record("post", opt))
        return optimizer

    def record(self, kind: str, optimizer: torch.optim.Optimizer) -> None:
        weights = sum(float(p.detach().sum()) for group in optimizer.param_groups for p in group["params"])
        group = optimizer.param_groups[0]
        self.calls.append(
            [
                kind,
                [len(group["params"]) for group in optimizer.param_groups],
                weights,
                [group["momentum"], group["weight_decay"]],
            ]
        )


def fit(schedule: str, out: Path) -> None:
    pl.seed_everything(3, verbose=False)
    calls: list = []
    model = MLP(calls)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))
    # several buckets (DeAR steps bucket by bucket); DeAR kept throughout (no turns with WFBP)
    options = {"dear": commsched.DeAROptions(fallback="never")} if schedule == "dear" else {}
    if schedule == "topk":
        options = {"compression": commsched.CompressionOptions(method="topk", density=0.5, sparsity_warmup_steps=0)}
    strategy = (
        DDPStrategy()
        if schedule == "ddp"
        else commsched.STRATEGIES[schedule.replace("topk", "wfbp")](bucket_cap_mb=0.0001, **options)
    )
    saves = (
        [ModelCheckpoint(dirpath=out / f"{schedule}-ckpt", every_n_train_steps=STEPS)]
        if schedule in ("ddp", "topk")
        else []
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=bool(saves),
        callbacks=saves,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out / f"{schedule}-run",
    )
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: model.record("global pre", opt)),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: model.record("global post", opt)),
    ]
    try:
        trainer.fit(model, DataLoader(data, batch_size=4))
    finally:
        for handle in handles:
            handle.remove()
    (out / f"{schedule}.rank{trainer.global_rank}.json").write_text(json.dumps(calls))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for schedule in sys.argv[2:]:
        fit(schedule, out)


if __name__ == "__main__":
    main()
