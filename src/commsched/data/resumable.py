"""A DataLoader that resumes in the middle of an epoch at the batch it had reached.

Lightning 2.6 saves the state of a training loader that has ``state_dict()`` / ``load_state_dict()``
(its ``_Stateful`` protocol) in every checkpoint, and gives it back before the resumed epoch starts.
A loader without them is replayed from its first batch, so a run resumed in the middle of an epoch
sees other batches than one that never stopped (Lightning warns "not resumable").
`ResumableDataLoader` is a `torch.utils.data.DataLoader` with the same constructor that implements
them: it counts the batches it has handed out in the current pass over the data, and a resumed
pass skips that many at the index sampler, so no skipped sample is loaded.

What makes it exact:

- The count is of batches *handed out*, not of indices drawn: worker processes prefetch indices
  ahead (``prefetch_factor``), and Lightning asks this loader for a batch only when its loop takes
  one (it prefetches a batch itself only from loaders without a length; this one always has one).
- Shuffles are a function of the pass: a sampler with ``set_epoch`` (the ``DistributedSampler``
  Lightning puts in under a distributed strategy) gets the pass number; ``shuffle=True`` on one
  process draws from a `NumberedShuffle`, seeded like Lightning's DistributedSampler (the loader's
  ``generator`` if given, else ``seed_everything``'s seed) plus the pass number, its seed kept in
  the state. The first pass takes its number from the sampler's epoch (what Lightning set), later
  ones count on, so a loader Lightning rebuilds (``reload_dataloaders_every_n_epochs``) still
  follows the epochs.
- A pass starts when its first batch is asked for, not when an iterator is made: Lightning makes
  iterators it never reads when it resumes at an epoch's end.
- A run that ended by ``max_steps`` in the middle of a pass counts that epoch as finished; resumed,
  the loader finishes the pass first (Lightning's epoch then ends early), then numbers its passes
  on from there, as the run that never stopped did. The first pass after a resume that Lightning
  leaves before its end is continued by the next iterator too: resuming a run bounded by
  ``max_steps`` from a checkpoint written at an epoch's end, Lightning takes one batch in the
  finished epoch, then starts the next.

Not covered: an ``IterableDataset`` (there are no indices to skip: use torchdata's
``StatefulDataLoader``), random draws a dataset makes from the global RNG (Lightning does not save
RNG states), a resume at another world size or batch size (the skip is scaled to the new pass
length, with a warning), a sampler of one's own that shuffles without ``set_epoch``, and
``limit_train_batches`` below a full pass (the loader cannot tell a pass Lightning cut at the
limit from one cut by ``max_steps``, and continues it).
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler

STATE_VERSION = 1


def first_seed(generator: Optional[torch.Generator]) -> int:
    """The seed of a shuffle: drawn from the loader's generator if it has one, else Lightning's global
    seed (`seed_everything`), as Lightning seeds the DistributedSampler it puts in, else drawn."""
    if generator is None and os.environ.get("PL_GLOBAL_SEED", "").lstrip("-").isdigit():
        return int(os.environ["PL_GLOBAL_SEED"])
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) % 2**62


class NumberedShuffle(RandomSampler):
    """A `RandomSampler` whose order is a function of its seed and epoch, like a `DistributedSampler`'s
    (Lightning calls `set_epoch` on it at every epoch), so a resumed run can draw it again."""

    def __init__(self, data_source: Any, seed: int) -> None:
        super().__init__(data_source)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return super().__iter__()


class _SkipFirst(Sampler):
    """The loader's index sampler, whose next pass leaves out the first `skip` batches of indices."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.skip = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        # A generator: the loader's iterator calls iter() on its index sampler more than once while it is
        # made; the skip belongs to the one that is read.
        skip, self.skip = self.skip, 0
        indices = iter(self.inner)
        for _ in range(skip):
            if next(indices, None) is None:
                return
        yield from indices


class ResumableDataLoader(DataLoader):
    """`torch.utils.data.DataLoader` (same arguments) that a checkpoint written mid-epoch resumes at the
    batch it had reached, for a map-style dataset. See the module's docstring for what is exact."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(DataLoader.__init__).bind(self, *args, **kwargs)
        given = bound.arguments
        dataset = given.get("dataset")
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "ResumableDataLoader skips batches by their indices, and an IterableDataset has none; "
                "use torchdata's StatefulDataLoader for it"
            )
        if given.get("shuffle") and given.get("sampler") is None and given.get("batch_sampler") is None:
            given["sampler"], given["shuffle"] = NumberedShuffle(dataset, first_seed(given.get("generator"))), None
        super().__init__(*bound.args[1:], **bound.kwargs)
        self._skipping: Optional[_SkipFirst] = None
        self._pass: Optional[int] = None  # the pass under way (or the last one)
        self._batches = 0  # batches of it handed out, skipped ones included
        self._pending: Optional[dict[str, Any]] = None  # a loaded state, applied when the next pass starts
        self._finished = False  # the pass ran to its end
        self._resumed = False  # the pass is the first since a state was loaded

    # ------------------------------------------------------------------ Lightning's _Stateful protocol
    def state_dict(self) -> dict[str, Any]:
        """Where the data stands: the pass, and the batches of it the training loop has taken."""
        if self._pending is not None:  # loaded, and no batch taken since: the same position
            return dict(self._pending)
        shuffle = self._shuffle()
        return {
            "version": STATE_VERSION,
            "pass": self._pass,
            "batches": self._batches,
            "length": len(self),
            "seed": shuffle.seed if shuffle is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The next pass resumes there (an empty state, or one written before any batch, changes nothing)."""
        if state_dict and state_dict.get("pass") is not None:
            self._pending = dict(state_dict)

    # ------------------------------------------------------------------ iteration
    @property
    def _index_sampler(self) -> Any:  # what torch's loader iterators draw indices from
        inner = super()._index_sampler
        skipping = getattr(self, "_skipping", None)
        if skipping is None or skipping.inner is not inner:
            skipping = self._skipping = _SkipFirst(inner)
        return skipping

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._pass_of_batches()

    def _pass_of_batches(self) -> Iterator[Any]:
        number, skip = self._next_pass()
        self._pass, self._batches, self._finished = number, skip, False
        self._order(number)
        self._index_sampler.skip = skip
        for batch in super().__iter__():
            self._batches += 1
            yield batch
        self._finished = True

    def _next_pass(self) -> tuple[int, int]:
        """The pass a new iterator reads, and how many of its batches it leaves out."""
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._resumed = True
            shuffle = self._shuffle()
            if shuffle is not None and state.get("seed") is not None:
                shuffle.seed = int(state["seed"])
            done, length = int(state["batches"]), len(self)
            if state.get("length") not in (None, length):
                scaled = done * length // int(state["length"])
                warnings.warn(
                    f"ResumableDataLoader: a pass now has {length} batches, {state['length']} when the checkpoint "
                    f"was written (another world size or batch size?): resuming after {scaled} of them, not "
                    f"{done}; the data order differs from the run that was not stopped",
                    stacklevel=3,
                )
                done = scaled if done < int(state["length"]) else length
            if done >= length:
                return int(state["pass"]) + 1, 0
            return int(state["pass"]), done
        resumed, self._resumed = self._resumed, False
        if resumed and not self._finished and self._pass is not None and self._batches < len(self):
            # Lightning left the first pass since the resume before its end: it resumed a run bounded by max_steps
            # from a checkpoint written at an epoch's end as that epoch still running, took one batch more in it
            # and ended it there. The run that did not stop took that batch as the first of the next epoch.
            return self._pass, self._batches
        if self._pass is not None:
            return self._pass + 1, 0
        epochs = [
            s.epoch
            for s in self._samplers()
            if callable(getattr(s, "set_epoch", None)) and isinstance(getattr(s, "epoch", None), int)
        ]
        return (epochs[0] if epochs else 0), 0

    def _samplers(self) -> list[Any]:
        """The samplers a pass can be numbered on: as Lightning's `_set_sampler_epoch` finds them."""
        found: dict[int, Any] = {}
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if sampler is not None:
                found[id(sampler)] = sampler
        return list(found.values())

    def _shuffle(self) -> Optional[NumberedShuffle]:
        found = [s for s in self._samplers() if isinstance(s, NumberedShuffle)]
        return found[0] if found else None

    def _order(self, number: int) -> None:
        """This pass's shuffle: a function of its number (and of the sampler's seed)."""
        for sampler in self._samplers():
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(number)
