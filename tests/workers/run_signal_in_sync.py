"""Ctrl-C landing on rank 0 while it is inside Lightning's synchronisation of a torchmetrics metric.

Usage: python run_signal_in_sync.py OUT_DIR        (2 processes on CPU, Lightning's launcher)

The validation metric's gather sends SIGINT to rank 0 itself, once, before it joins the gather: the
signal handler then runs in the middle of a collective sequence every rank must issue alike. A
`ModelCheckpoint` that monitors the metric keeps `last`, so the checkpoint's file name depends on
the metrics. Every rank writes OUT_DIR/result.rank<r>.pt: the step it stopped at and what it saved.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.utilities.distributed import gather_all_tensors

from commsched import DeARStrategy, StopAndSave, StoppedBySignal
from commsched.cli.quiet import quiet_lightning

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*log_every_n_steps.*")

ARM_AT_STEP = 4
"""The first validation at or after this step signals: the fit's first, after training started (and
`StopAndSave` took the signals), before the `ModelCheckpoint` has a `last` file whose name it could reuse."""


class SignalInGather:
    """A gather in two rounds of collectives, the shapes then the values (as torchmetrics' own does for a
    tensor state), with a SIGINT to this process between them, once, on rank 0: a terminal's Ctrl-C
    landing in the middle of the sequence."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = False

    def __call__(self, tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
        shapes = gather_all_tensors(torch.tensor(tensor.shape, dtype=torch.long), group=group)
        assert all(torch.equal(shape, shapes[0]) for shape in shapes), shapes
        if self.armed and not self.fired and torch.distributed.get_rank() == 0:
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return gather_all_tensors(tensor, group=group)


class Net(pl.LightningModule):
    def __init__(self, gather: SignalInGather) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.gather = gather
        self.val_loss = MeanMetric(dist_sync_fn=gather)
        self.train_loss = MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.train_loss(loss)
        self.log("train_loss", self.train_loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_loss(F.mse_loss(self.net(x), y))
        self.log("val_loss", self.val_loss)

    def on_validation_epoch_start(self) -> None:
        self.gather.armed = self.trainer.global_step >= ARM_AT_STEP

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    out = Path(sys.argv[1])
    quiet_lightning()
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
    model = Net(SignalInGather())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DeARStrategy(timeout=timedelta(seconds=60)),  # a hang fails the run within a minute
        max_steps=1000,
        val_check_interval=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        default_root_dir=out,  # the run's files (the profile) go there, not into the current folder
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_last=True, save_top_k=1),
            StopAndSave(),
        ],
    )
    result = {"stopped": None}
    try:
        trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    except StoppedBySignal as stop:
        result["stopped"] = {"step": stop.step, "saved": str(stop.saved)}
    result["global_step"] = trainer.global_step
    result["fired"] = model.gather.fired
    torch.save(result, out / f"result.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
