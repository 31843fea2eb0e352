"""Data caching ([Cloud-TopK] §4.1, DataCache): files from a slow directory (NFS, a mounted bucket)
copied once to local disk, and decoded samples kept in memory from the second epoch on.

    root = local_copy("/nfs/imagenet/train", "/tmp/commsched-cache")   # once per node, other ranks wait
    dataset = CachedDataset(torchvision.datasets.ImageFolder(root, transform=decode))

Random augmentations belong after the cache (applied to the cached decoded sample), or every
epoch would see the first epoch's draws. With DataLoader workers, each worker process keeps its own
cache: use `persistent_workers=True`, or the cache is rebuilt each epoch.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from torch.utils.data import Dataset

from commsched.errors import bad_value


class CachedDataset(Dataset):
    """Any map-style dataset whose samples, once read and decoded, are kept in memory."""

    def __init__(self, dataset: Any, transform: Optional[Callable[[Any], Any]] = None) -> None:
        """`transform`: applied to the cached sample on every access (random augmentation)."""
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise bad_value(
                "CachedDataset.dataset", type(dataset).__name__, "a map-style dataset (__getitem__ and __len__)"
            )
        self.dataset = dataset
        self.transform = transform
        self._samples: dict[int, Any] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if index in self._samples:
            self.hits += 1
            sample = self._samples[index]
        else:
            self.misses += 1
            sample = self._samples[index] = self.dataset[index]
        return self.transform(sample) if self.transform is not None else sample


def local_copy(source: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """`source`'s tree copied under `cache_dir` (kept for later runs): the local path to read from.

    The copy is named by the source's full path (two folders both called `data` get copies of their
    own) and remembers what it was copied from: every file's relative path, size and modification
    time. A later run whose source still matches reads the copy; one whose source changed (a file
    added, removed or rewritten) copies it again. Processes of one node calling it together copy
    once (a file lock); a copy cut short is never used (it is renamed into place only when complete)."""
    source = Path(source).expanduser().resolve()
    if not source.is_dir():
        raise bad_value("local_copy.source", str(source), "an existing directory")
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    name = f"{source.name}-{hashlib.sha1(str(source).encode()).hexdigest()[:10]}"
    target, stamp_file = cache / name, cache / f".{name}.source.json"
    with open(cache / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = _fingerprint(source)
        if target.exists() and stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
            return target
        partial = cache / f".{name}.partial-{os.getpid()}"
        stale = cache / f".{name}.stale-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            shutil.copytree(source, partial)
            if target.exists():
                target.rename(stale)
            partial.rename(target)
            stamp_file.write_text(json.dumps(stamp))
        finally:
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(stale, ignore_errors=True)
    return target


def _fingerprint(source: Path) -> list[list]:
    """What the copy is checked against: each file's path below `source`, size and mtime (ns)."""
    entries = []
    for folder, _dirs, files in os.walk(source):
        for file in files:
            path = Path(folder) / file
            stat = path.stat()
            entries.append([str(path.relative_to(source)), stat.st_size, stat.st_mtime_ns])
    return sorted(entries)
