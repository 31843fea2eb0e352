"""ImageClassifier: any image backbone of the zoo as a LightningModule with accuracy metrics."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from commsched.errors import bad_value
from commsched.model_names import IMAGE_ARCHS
from commsched.models import optim
from commsched.models.resnet import ResNet
from commsched.models.small_cnn import SmallCNNBackbone
from commsched.models.vgg import VGG


def build_backbone(arch: str, num_classes: int, cifar: bool, width: int) -> nn.Module:
    """`cifar` selects the 32x32 stem (ResNet) or head (VGG); `width` 64 is the standard network."""
    if arch.startswith("resnet") and arch in IMAGE_ARCHS:
        return ResNet(int(arch.removeprefix("resnet")), num_classes, cifar_stem=cifar, width=width)
    if arch.startswith("vgg") and arch in IMAGE_ARCHS:
        depth = int(arch.removeprefix("vgg").removesuffix("_bn"))
        return VGG(depth, num_classes, batch_norm=arch.endswith("_bn"), cifar_head=cifar, width=width)
    if arch == "small_cnn":
        return SmallCNNBackbone(width=width, num_classes=num_classes)
    raise bad_value("model.arch", arch, IMAGE_ARCHS)


class ImageClassifier(optim.HparamsOptimizer, pl.LightningModule):
    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        cifar: bool = True,
        width: int = 64,
        optimizer: str = "sgd",
        lr: float = 0.1,
        weight_decay: float = 5e-4,
        momentum: float = 0.9,
        lr_schedule: str = "constant",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = build_backbone(arch, num_classes, cifar, width)
        side = 32 if cifar else 224
        self.example_input_array = torch.zeros(1, 3, side, side)  # the model summary counts FLOPs on it
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)
