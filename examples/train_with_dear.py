"""train_with_dear.py: an ordinary Lightning script, trained with `strategy="dear"`.

Nothing in the LightningModule, the data or the callbacks knows about commsched: importing it
registers the strategies by name, and `Trainer(strategy="dear")` is the only change from a `ddp`
script. The data is scikit-learn's handwritten digits (real images, shipped with the library).

    python examples/train_with_dear.py                       # 2 CPU processes, 2 epochs
    python examples/train_with_dear.py --strategy ddp        # the same run under Lightning's ddp
    python examples/train_with_dear.py --max-steps 10        # a quick look
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import commsched  # noqa: F401  (registers "wfbp", "dear", "deft", "topk" with Lightning)


class DigitsNet(pl.LightningModule):
    """A small convolutional classifier for 8x8 digit images."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == labels).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)]


def digits(train: bool) -> TensorDataset:
    """The 1,797 digit images, 8x8 with values 0..16: the first 1,500 to train on, the rest to validate."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target)
    part = slice(0, 1500) if train else slice(1500, None)
    return TensorDataset(images[part], labels[part])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="dear", help="dear, wfbp, deft, topk or Lightning's ddp")
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (see emulated_cluster.sh)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=-1)
    args = parser.parse_args()

    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=[LearningRateMonitor()],
        enable_progress_bar=False,
        default_root_dir="outputs/train_with_dear",
    )
    model, validation = DigitsNet(), DataLoader(digits(train=False), batch_size=64)
    trainer.fit(model, DataLoader(digits(train=True), batch_size=32, shuffle=True), validation)
    metrics = trainer.validate(model, validation, verbose=False)[0]  # the trained model, whatever step it stopped at
    if trainer.is_global_zero:
        print(
            f"{args.strategy}: val_acc {metrics['val_acc']:.4f}, val_loss {metrics['val_loss']:.4f} "
            f"after {trainer.global_step} steps"
        )


if __name__ == "__main__":
    main()
