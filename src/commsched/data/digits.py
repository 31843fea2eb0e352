"""scikit-learn's handwritten digits (1797 8x8 images, shipped with the package: no download),
resized to the models' input size: a real dataset for convergence runs on any machine."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from commsched.data.base import SplitDataModule


def load_digits_tensors(resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False)
    images = ((images - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()
    return images, torch.tensor(digits.target, dtype=torch.int64)


class DigitsData(SplitDataModule):
    """A fixed, seeded split: `val_fraction` of the digits for validation, the rest for training."""

    def __init__(
        self, batch_size: int = 64, resolution: int = 32, val_fraction: float = 0.2, seed: int = 0, num_workers: int = 0
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.resolution, self.val_fraction, self.seed = resolution, val_fraction, seed

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        images, labels = load_digits_tensors(self.resolution)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        n_val = int(len(labels) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])
