"""A script written as LightningCLI scripts are, for test_lightning_cli.py: the strategy comes from the command
line or a YAML config (`--trainer.strategy=dear`, or `class_path: commsched.DeARStrategy` with `init_args`).

Usage: python run_lightning_cli.py fit [LightningCLI arguments...]   (COMMSCHED_CLI_OUT: where rank 0 writes
the trained weights, as <COMMSCHED_CLI_OUT>.pt)
"""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import commsched  # noqa: F401  (registers "dear", "wfbp", ... and makes commsched.DeARStrategy importable)

warnings.filterwarnings("ignore")


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(6, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
        )

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(
            TensorDataset(torch.randn(256, 6, generator=g), torch.randn(256, 1, generator=g)), batch_size=8
        )

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero:
            torch.save(
                {k: v.detach().clone() for k, v in self.state_dict().items()}, os.environ["COMMSCHED_CLI_OUT"] + ".pt"
            )
            print(f"STRATEGY {type(self.trainer.strategy).__name__}", flush=True)


if __name__ == "__main__":
    LightningCLI(Regressor, save_config_callback=None)
