"""Synthetic images: deterministic, generated on the fly, so throughput runs need no data on disk."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticImages(Dataset):
    """`size` random images of shape (3, resolution, resolution) with labels; sample i is fixed by (seed, i)."""

    def __init__(self, size: int, resolution: int = 32, num_classes: int = 10, seed: int = 0) -> None:
        self.size, self.resolution, self.num_classes, self.seed = size, resolution, num_classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(3, self.resolution, self.resolution, generator=g)
        return image, int(torch.randint(self.num_classes, (1,), generator=g))
