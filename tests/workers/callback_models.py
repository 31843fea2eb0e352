"""LightningModules for the callback tests: a RegNet from `transformers` (a third-party model, built
from a config, no download) and the project's own ResNet, both as `backbone` + `head` so that
`BackboneFinetuning` can freeze and unfreeze the backbone."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 5


def regnet() -> tuple[nn.Module, nn.Module]:
    from transformers import RegNetConfig, RegNetModel

    config = RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2], groups_width=8)
    return RegNetModel(config), nn.Sequential(nn.Flatten(), nn.Linear(16, NUM_CLASSES))


def own_resnet() -> tuple[nn.Module, nn.Module]:
    from commsched.models import ResNet

    net = ResNet(18, NUM_CLASSES, cifar_stem=True, width=4)
    head = net.fc
    net.fc = nn.Identity()
    return net, head


ARCHS = {"regnet": regnet, "resnet": own_resnet}


class Classifier(pl.LightningModule):
    """SGD with momentum and weight decay, a per-step LR schedule; only trainable parameters are
    handed to the optimizer (what `BackboneFinetuning` expects)."""

    def __init__(self, arch: str = "regnet", samples: int = 48, batch_size: int = 4, lr_schedule: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone, self.head = ARCHS[arch]()
        self.lr = 0.05  # what Lightning's LearningRateFinder sets
        self.weights_seen: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.backbone(images)
        if hasattr(features, "pooler_output"):  # transformers' RegNetModel
            features = features.pooler_output
        return self.head(features)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("val_loss", F.cross_entropy(self(images), labels), sync_dist=True)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=self.lr, momentum=0.9, weight_decay=1e-3)
        if not self.hparams.lr_schedule:  # BackboneFinetuning adds a param group, which LambdaLR cannot follow
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _loader(self, seed: int, size: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        images = torch.randn(size, 3, 16, 16, generator=g)
        labels = torch.randint(0, NUM_CLASSES, (size,), generator=g)
        return DataLoader(TensorDataset(images, labels), batch_size=self.hparams.batch_size, shuffle=seed == 1)

    def train_dataloader(self):
        return self._loader(1, self.hparams.samples)

    def val_dataloader(self):
        return self._loader(2, 8)


class WeightReader(Classifier):
    """A user's own hook that reads a weight after every step."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.weights_seen.append(next(self.backbone.parameters()).detach().clone())
