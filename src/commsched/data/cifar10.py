"""CIFAR-10 from the standard python-pickle batch files on disk (no download: this runs offline).

Expected in `dir`: data_batch_1 .. data_batch_5 and test_batch, as unpacked from
cifar-10-python.tar.gz (each a pickle of {b"data": uint8 N x 3072, b"labels": [int]}).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from commsched.data.base import SplitDataModule
from commsched.errors import CommSchedConfigError

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def check_cifar10_dir(directory: str | Path) -> Path:
    path = Path(directory).expanduser()
    missing = [name for name in (*TRAIN_FILES, TEST_FILE) if not (path / name).is_file()]
    if missing:
        raise CommSchedConfigError(
            f"commsched: data.dir={str(directory)!r} does not hold CIFAR-10: missing {', '.join(missing)}. "
            "Place the python-pickle batch files there (data_batch_1 .. data_batch_5 and test_batch, "
            "unpacked from cifar-10-python.tar.gz); nothing is downloaded."
        )
    return path


def read_batches(directory: Path, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as uint8 (N, 3, 32, 32) and labels as int64 (N,)."""
    images, labels = [], []
    for name in names:
        with open(directory / name, "rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        images.append(torch.as_tensor(batch[b"data"], dtype=torch.uint8).view(-1, 3, 32, 32))
        labels.append(torch.as_tensor(batch[b"labels"], dtype=torch.int64))
    return torch.cat(images), torch.cat(labels)


class Cifar10(Dataset):
    """Normalised images; training adds the standard pad-4 random crop and horizontal flip."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool) -> None:
        self.images, self.labels, self.augment = images, labels, augment
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = (self.images[index].float() / 255 - self.mean) / self.std
        if self.augment:
            dx, dy = torch.randint(0, 9, (2,)).tolist()
            image = F.pad(image, (4, 4, 4, 4))[:, dy : dy + 32, dx : dx + 32]
            if torch.rand(()) < 0.5:
                image = image.flip(2)
        return image, self.labels[index]


class Cifar10Data(SplitDataModule):
    def __init__(
        self, dir: str = "~/data/cifar-10-batches-py", batch_size: int = 128, augment: bool = True, num_workers: int = 0
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.dir = check_cifar10_dir(dir)
        self.augment = augment

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set = Cifar10(*read_batches(self.dir, TRAIN_FILES), augment=self.augment)
            self.val_set = Cifar10(*read_batches(self.dir, (TEST_FILE,)), augment=False)
