"""torchmetrics in a LightningModule under ddp and each schedule: a metric logged every step and synced
at the epoch's end, one synced on every step (`dist_sync_on_step`: an all-gather on the default group in
the middle of the training step, while a schedule's own exchanges are in flight on its links), a
validation loss synced across ranks. Saves the weights, what the step-synced metric returned each step,
and the Trainer's final metrics.

Usage: python run_torchmetrics.py OUT_DIR SCHEDULE [SCHEDULE ...]   (ddp, wfbp, dear, deft: at their defaults)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import commsched  # noqa: F401  (registers the schedules' names)

warnings.filterwarnings("ignore", ".*does not have many workers.*")
CLASSES = 5


class Measured(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES)
        self.mean_loss = torchmetrics.MeanMetric(dist_sync_on_step=True)
        self.mean_seen: list[float] = []

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        logits = self.net(inputs)
        loss = F.cross_entropy(logits, labels)
        self.accuracy(logits, labels)
        self.log("accuracy", self.accuracy, on_step=True, on_epoch=True, sync_dist=True)
        self.mean_seen.append(float(self.mean_loss(loss.detach())))
        self.log("mean_loss", self.mean_loss, on_step=True)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, labels = batch
        self.log("val_loss", F.cross_entropy(self.net(inputs), labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def _loader(self, seed: int, size: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        data = TensorDataset(torch.randn(size, 20, generator=g), torch.randint(0, CLASSES, (size,), generator=g))
        return DataLoader(data, batch_size=8)

    def train_dataloader(self):
        return self._loader(1, 160)

    def val_dataloader(self):
        return self._loader(2, 32)


def main() -> None:
    out, schedules = Path(sys.argv[1]), sys.argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    for schedule in schedules:
        pl.seed_everything(0, verbose=False)
        model = Measured()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=DDPStrategy() if schedule == "ddp" else schedule,
            max_epochs=3,
            val_check_interval=0.5,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(model)
        torch.save(
            {
                "state": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
                "mean_seen": model.mean_seen,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "steps": trainer.global_step,
            },
            out / f"{schedule}.rank{trainer.global_rank}.pt",
        )


if __name__ == "__main__":
    main()
