"""Epoch time with and without `commsched.data.CachedDataset`: N 32x32 PNG images decoded by
matplotlib (a real decode per read), read through a DataLoader for 3 epochs.

    .venv/bin/python recipes/data_cache.py [N]       # default 3000 images; about a minute
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from commsched.data import CachedDataset, local_copy


class PngFolder(Dataset):
    def __init__(self, root: Path) -> None:
        self.files = sorted(root.glob("*.png"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(matplotlib.image.imread(self.files[index])[..., :3])).permute(
            2, 0, 1
        )


def epochs(dataset: Dataset, n: int = 3) -> list[float]:
    times = []
    for epoch in range(n):
        loader = DataLoader(dataset, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(epoch))
        started = time.perf_counter()
        for _ in loader:
            pass
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        slow = Path(tmp) / "images"
        slow.mkdir()
        rng = np.random.default_rng(0)
        for i in range(count):
            matplotlib.image.imsave(slow / f"{i:05d}.png", rng.random((32, 32, 3)))
        started = time.perf_counter()
        root = local_copy(slow, Path(tmp) / "cache")
        copy_s = time.perf_counter() - started
        plain = epochs(PngFolder(root))
        cached = epochs(CachedDataset(PngFolder(root)))
    print(f"{count} PNG images, copied to local disk once in {copy_s:.2f} s")
    print("| epoch | plain (s) | CachedDataset (s) |")
    print("|---|---|---|")
    for epoch, (a, b) in enumerate(zip(plain, cached), 1):
        print(f"| {epoch} | {a:.2f} | {b:.2f} |")


if __name__ == "__main__":
    main()
