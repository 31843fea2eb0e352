"""What every data module shares: loaders over `train_set` / `val_set` built in `setup`, and exact
resumption in the middle of an epoch.

Lightning replaces the samplers with DistributedSamplers under a distributed strategy (shuffle
kept for training, seed fixed), so every rank sees its own deterministic share. A checkpoint
written mid-epoch records how many batches of the epoch the loop had processed (the data module's
state, saved by Lightning); the resumed run's loader skips exactly those, so a run stopped at step
k and resumed sees the same batches as one that never stopped.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl


class ResumableLoader(DataLoader):
    """A DataLoader that counts its passes over the data and can start one `skip_batches` in.

    Each pass sets the (distributed) sampler's epoch to the pass number itself: Lightning counts an
    epoch that `max_steps` cut short as finished, so after such a resume its epoch numbers run one
    ahead of the data's, and the shuffles would differ from an uninterrupted run's."""

    def __init__(self, *args: Any, skip_batches: int = 0, first_pass: int = 0, empty_first: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_batches = skip_batches
        self.current_pass = first_pass - 1
        self._next_pass = first_pass
        self._empty_first = empty_first

    def __iter__(self) -> Iterator[Any]:
        if self._empty_first:  # see SplitDataModule.train_dataloader
            self._empty_first = False
            return iter(())
        self.current_pass, self._next_pass = self._next_pass, self._next_pass + 1
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.current_pass)
        iterator = super().__iter__()
        skip, self.skip_batches = self.skip_batches, 0
        for _ in range(skip):
            next(iterator)
        return iterator

    # The position lives in the data module (it knows what the loop processed, the loader only what it
    # prefetched); declaring the interface tells Lightning this loader resumes exactly.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class SplitDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self._resume: Optional[dict[str, int]] = None

    def _loader(self, dataset: Optional[Dataset], shuffle: bool, **position: int) -> DataLoader:
        assert dataset is not None, "setup() has not run"
        return ResumableLoader(
            dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
            drop_last=shuffle, persistent_workers=self.num_workers > 0, **position,
        )

    def train_dataloader(self) -> DataLoader:
        position = {}
        if self._resume is not None:
            if self._resume["batches"] >= self._resume["length"]:
                # The pass was finished. A run bounded by steps is restored by Lightning as that epoch still
                # running (one by epochs as the next epoch): it gets no more batches, the next epoch the next pass.
                position = {"first_pass": self._resume["pass"] + 1, "empty_first": self.trainer.max_steps != -1}
            else:
                position = {"first_pass": self._resume["pass"], "skip_batches": self._resume["batches"]}
        self._resume = None
        return self._loader(self.train_set, shuffle=True, **position)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def state_dict(self) -> dict[str, Any]:
        """Where the training data stands: its pass and the batches of it the loop has processed."""
        loader = self.trainer.train_dataloader if self.trainer is not None and self.trainer.training else None
        if not isinstance(loader, ResumableLoader):
            return {}
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"pass": loader.current_pass, "batches": progress.processed, "length": len(loader)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict) if state_dict else None
