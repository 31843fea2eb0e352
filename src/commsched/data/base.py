"""What every data module shares: loaders over `train_set` / `val_set` built in `setup`.

Lightning replaces the samplers with DistributedSamplers under a distributed strategy (shuffle
kept for training, seed fixed), so every rank sees its own deterministic share.
"""

from __future__ import annotations

from typing import Optional

from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl


class SplitDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def _loader(self, dataset: Optional[Dataset], shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() has not run"
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
            drop_last=shuffle, persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
