"""Synthetic images and tokens: deterministic, generated on the fly, the default for throughput runs."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from commsched.data.base import SplitDataModule


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class SyntheticImages(Dataset):
    """`size` random images of shape (3, resolution, resolution) with labels; sample i is fixed by (seed, i)."""

    def __init__(self, size: int, resolution: int = 32, num_classes: int = 10, seed: int = 0) -> None:
        self.size, self.resolution, self.num_classes, self.seed = size, resolution, num_classes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = _generator(self.seed, index)
        image = torch.randn(3, self.resolution, self.resolution, generator=g)
        return image, int(torch.randint(self.num_classes, (1,), generator=g))


class SyntheticTokens(Dataset):
    """`size` random token windows: (inputs, targets) shifted by one, as a causal LM expects."""

    def __init__(self, size: int, block_size: int = 64, vocab_size: int = 256, seed: int = 0) -> None:
        self.size, self.block_size, self.vocab_size, self.seed = size, block_size, vocab_size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.randint(self.vocab_size, (self.block_size + 1,), generator=_generator(self.seed, index))
        return window[:-1], window[1:]


class SyntheticImageData(SplitDataModule):
    def __init__(
        self,
        batch_size: int = 32,
        train_size: int = 2048,
        val_size: int = 256,
        resolution: int = 32,
        num_classes: int = 10,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.train_set = SyntheticImages(train_size, resolution, num_classes, seed)
        self.val_set = SyntheticImages(val_size, resolution, num_classes, seed + 1)


class SyntheticTokenData(SplitDataModule):
    def __init__(
        self,
        batch_size: int = 16,
        train_size: int = 2048,
        val_size: int = 256,
        block_size: int = 64,
        vocab_size: int = 256,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.train_set = SyntheticTokens(train_size, block_size, vocab_size, seed)
        self.val_set = SyntheticTokens(val_size, block_size, vocab_size, seed + 1)
