"""A small VGG-style CNN for 32x32 images: big enough that communication matters, small enough for CPUs."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class SmallCNNBackbone(nn.Module):
    """`width` scales every layer; width=64 gives 3.06 M parameters."""

    def __init__(self, width: int = 64, num_classes: int = 10, hidden: int = 512) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            _block(3, w),
            nn.MaxPool2d(2),
            _block(w, 2 * w),
            nn.MaxPool2d(2),
            _block(2 * w, 4 * w),
            _block(4 * w, 4 * w),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(4 * w * 16, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, num_classes)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


class SmallCNN(pl.LightningModule):
    """SmallCNNBackbone with plain SGD: the demo's and benchmark's model."""

    def __init__(self, width: int = 64, num_classes: int = 10, lr: float = 0.05, hidden: int = 512) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = SmallCNNBackbone(width, num_classes, hidden)
        self.example_input_array = torch.zeros(1, 3, 32, 32)  # the model summary counts FLOPs on it

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4)
