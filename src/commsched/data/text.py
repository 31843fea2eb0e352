"""Byte-level text for GPT-2 from any local file or directory.

With no path, the corpus is the English text of Python's own documentation topics, which every
CPython installation ships (`pydoc_data/topics.py`, about 0.8 MB): real text, no download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import Dataset

from commsched.data.base import SplitDataModule
from commsched.errors import CommSchedConfigError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".tex", ".csv", ".json", ".html"}


def default_corpus() -> Path:
    import pydoc_data.topics

    return Path(pydoc_data.topics.__file__)


def read_bytes(path: Optional[str | Path]) -> torch.Tensor:
    """All bytes of a file, or of the text files under a directory (sorted, so every rank agrees)."""
    source = Path(path).expanduser() if path else default_corpus()
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    else:
        raise CommSchedConfigError(f"commsched: data.path={str(path)!r} is neither a file nor a directory.")
    data = b"\n".join(f.read_bytes() for f in files)
    if not data:
        raise CommSchedConfigError(
            f"commsched: data.path={str(path)!r} holds no text (looked for files ending in {sorted(TEXT_SUFFIXES)})."
        )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class TokenWindows(Dataset):
    """Non-overlapping windows of `block_size + 1` tokens, split into (inputs, targets)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise CommSchedConfigError(
                f"commsched: the text has {len(tokens)} bytes, fewer than data.block_size + 1 = {block_size + 1}."
            )
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


class ByteTextData(SplitDataModule):
    """The last `val_fraction` of the bytes is held out for validation."""

    def __init__(
        self,
        path: Optional[str] = None,
        block_size: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers)
        self.path, self.block_size, self.val_fraction = path, block_size, val_fraction

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        tokens = read_bytes(self.path)
        split = int(len(tokens) * (1 - self.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.block_size)
        self.val_set = TokenWindows(tokens[split:], self.block_size)
