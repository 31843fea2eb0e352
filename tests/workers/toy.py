"""A tiny LightningModule that touches every path the strategies must get right.

conv + BatchNorm + linear + embedding, a weight tied between the embedding and a head, a frozen
layer (still handed to the optimizer), a branch that is unused on some steps on all ranks and on
others on one rank only, a parameter of the LightningModule itself read in `training_step`
before any module runs, and a parameter read directly from a module that is never called.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class ToyData(Dataset):
    """Deterministic samples: a 3x6x6 image, three tokens, a label."""

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 3, 6, 6, generator=g)
        self.tokens = torch.randint(0, 10, (size, 3), generator=g)
        self.labels = torch.randint(0, 5, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.tokens[i], self.labels[i]


def branch_used(step: int, rank: int) -> bool:
    """Unused on every rank every third step, unused on rank 1 only on the step after."""
    return not (step % 3 == 0 or (step % 3 == 1 and rank == 1))


class ToyNet(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd", batch_size: int = 4, train_size: int = 96, val_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)  # as before any BatchNorm: a bias there has no gradient
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(64, 12)
        self.embed = nn.Embedding(10, 12)
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(12, 12)
        self.head = nn.Linear(12, 5)
        self.token_head = nn.Linear(12, 10, bias=False)
        self.token_head.weight = self.embed.weight  # tied
        self.aux = nn.Linear(1, 12, bias=False)  # never called: its weight is read directly
        self.input_gain = nn.Parameter(torch.ones(3, 1, 1))  # read before any module runs

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(images))).flatten(1)
        h = self.fc(h) + self.embed(tokens).mean(1)
        h = torch.tanh(self.frozen(h)) * self.aux.weight.view(-1)
        if use_branch:
            h = h + self.branch(h)
        return h

    def _loss(self, batch, use_branch: bool) -> torch.Tensor:
        images, tokens, labels = batch
        h = self(images * self.input_gain, tokens, use_branch)
        return F.cross_entropy(self.head(h), labels) + 0.5 * F.cross_entropy(self.token_head(h), tokens[:, 0])

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch, branch_used(self.global_step, self.global_rank))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch, True), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch, True), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.head(self(batch[0], batch[1]))

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
        elif self.hparams.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        elif self.hparams.optimizer == "lbfgs":
            opt = torch.optim.LBFGS(self.parameters())
        else:
            raise ValueError(self.hparams.optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(ToyData(self.hparams.train_size, seed=1), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(ToyData(self.hparams.val_size, seed=2), batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_dataloader(self):
        return self.val_dataloader()


class UnfreezingToyNet(ToyNet):
    """Makes the frozen layer trainable at step 6 and hands it to the optimizer, as BaseFinetuning does."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 6 and not self.frozen.weight.requires_grad:
            self.frozen.requires_grad_(True)
