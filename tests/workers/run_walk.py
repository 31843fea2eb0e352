"""A real DeFT run on least squares, for checking the Preserver's walk against the loss it predicts.

Usage: python run_walk.py OUT_DIR

Two ranks, 64 noisy dimensions, SGD with momentum. Rank 0 writes OUT_DIR/walk.pt: the walk's
starting point as the Preserver measured it, the step whose loss it read, and after every step's
start the loss and squared gradient norm over the whole data set (computed here, apart from the
engine).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

import commsched
from commsched.data.base import ResumableLoader

warnings.filterwarnings("ignore", ".*does not have many workers.*")

DIMS, SAMPLES, BATCH, NOISE = 64, 4096, 64, 1.0
LR, MOMENTUM = 0.002, 0.5
WARMUP, MEASURE, AFTER = 2, 4, 12


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, DIMS, generator=g)
    truth = torch.randn(DIMS, generator=g)
    return TensorDataset(x, x @ truth + NOISE * torch.randn(SAMPLES, generator=g))


def half_squared_error(prediction: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((prediction.squeeze(-1) - y) ** 2).mean()


class LeastSquares(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIMS, 1, bias=False)
        nn.init.zeros_(self.linear.weight)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return half_squared_error(self.linear(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self):
        return ResumableLoader(data(), batch_size=BATCH, shuffle=True)


class WholeDataLoss(pl.Callback):
    """The loss and |grad L|^2 over every sample, at the weights each step starts from."""

    def __init__(self) -> None:
        self.loss: dict[int, float] = {}
        self.gradient_norm2: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x, y = data().tensors
        weight = pl_module.linear.weight.detach().clone().requires_grad_(True)
        loss = half_squared_error(x @ weight.t(), y)
        (gradient,) = torch.autograd.grad(loss, weight)
        self.loss[trainer.global_step] = float(loss)
        self.gradient_norm2[trainer.global_step] = float((gradient**2).sum())


def main(out: Path) -> None:
    pl.seed_everything(5, verbose=False)
    whole = WholeDataLoss()
    preserver = commsched.Preserver()
    strategy = commsched.DeFTStrategy(
        deft=commsched.DeFTOptions(
            warmup_steps=WARMUP, measure_steps=MEASURE, cost_repeats=1, capacity=None, fallback="never"
        )
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=WARMUP + MEASURE + AFTER,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[whole, preserver],
        default_root_dir=out / "run",
    )
    trainer.fit(LeastSquares())
    if trainer.global_rank == 0:
        torch.save(
            {
                "walk": preserver.decisions[-1]["walk"],
                "read_at": WARMUP + MEASURE - 1,
                "loss": whole.loss,
                "gradient_norm2": whole.gradient_norm2,
                "lr": LR,
                "momentum": MOMENTUM,
                "after": AFTER,
            },
            out / "walk.pt",
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
