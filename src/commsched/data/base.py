"""What every data module shares: loaders over `train_set` / `val_set` built in `setup`, and exact
resumption in the middle of an epoch.

Lightning replaces the samplers with DistributedSamplers under a distributed strategy (shuffle
kept for training, seed fixed), so every rank sees its own deterministic share. The training loader
is a `ResumableDataLoader`: a checkpoint holds the pass over the data and the batches of it the
loop had taken, and the resumed run's loader leaves those out (at the sampler: none is loaded), so
a run stopped at step k and resumed sees the same batches as one that never stopped.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from commsched.data.resumable import ResumableDataLoader


class ResumableLoader(DataLoader):
    """A DataLoader that counts its passes over the data and can start one `skip_batches` in (it loads
    the batches it skips). Kept for the test workers that set the position themselves; the data
    modules use `ResumableDataLoader`, which keeps its position in the checkpoint.

    Each pass sets the (distributed) sampler's epoch to the pass number itself: Lightning counts an
    epoch that `max_steps` cut short as finished, so after such a resume its epoch numbers run one
    ahead of the data's, and the shuffles would differ from an uninterrupted run's."""

    def __init__(
        self, *args: Any, skip_batches: int = 0, first_pass: int = 0, empty_first: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.skip_batches = skip_batches
        self.current_pass = first_pass - 1
        self._next_pass = first_pass
        self._empty_first = empty_first

    def __iter__(self) -> Iterator[Any]:
        if self._empty_first:
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

    # Declaring the interface tells Lightning this loader resumes exactly (its user sets the position).
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

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() has not run"
        return ResumableDataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            drop_last=True,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() has not run"
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
