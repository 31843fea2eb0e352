"""Where a run's own files go, and how they are written.

A run's plan, profile and stream trials belong beside its logs: in the folder of the Trainer's
first logger (``lightning_logs/version_N`` by default, the Hydra run directory under
``commsched-train``), or ``default_root_dir`` when the Trainer has no logger but saves checkpoints
there or was given that folder. A run with none of them (``logger=False, enable_checkpointing=False``
in the working directory) has no folder, and Lightning writes nothing: then neither does commsched, unless a file
was asked for by name (a profile's ``out_dir``); the closing summary still says what was decided. Only rank 0
writes, and every file appears whole (written beside its final name, then renamed), so a reader never sees half a file
and ranks on a shared filesystem never interleave. JSON is strict: a non-finite number (a step
that was never timed) is written as ``null``, since ``NaN`` is not JSON and strict parsers reject it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional


def run_folder(trainer: Any) -> Optional[Path]:
    """The run's folder (None: it has none). Collective: `Trainer.log_dir` broadcasts rank 0's
    answer, so every rank must call this at the same point (the strategy does, in `setup`)."""
    if trainer.loggers:
        folder = trainer.log_dir
        return Path(folder if folder else trainer.default_root_dir).expanduser()
    return _checkpoint_folder(trainer)


def _checkpoint_folder(trainer: Any) -> Optional[Path]:
    """`default_root_dir` when checkpoints go there or the user named it (it is the working directory otherwise)."""
    root = Path(trainer.default_root_dir).expanduser()
    named = root.resolve() != Path.cwd().resolve()
    return root if trainer.checkpoint_callbacks or named else None


def folder_of(trainer: Any) -> Optional[Path]:
    """The folder the strategy resolved for this fit (None: the run has no folder); not collective."""
    strategy = trainer.strategy
    if getattr(strategy, "run_dir_resolved", False):
        return strategy.run_dir
    if trainer.loggers:  # as `Trainer.log_dir` finds it, without its broadcast: callers may run on one rank
        logger = trainer.loggers[0]
        return Path(getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir).expanduser()
    return _checkpoint_folder(trainer)


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, through dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


WRITTEN: list[Path] = []
"""Every file this process wrote through this module, in order (the closing summary lists this fit's)."""


def write_whole(path: Path, write: Callable[[Path], Any]) -> Path:
    """`write(p)` writes the file at a temporary path beside `path` (same suffix, so a plot library
    picks the format from it), then it becomes `path`: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    WRITTEN.append(path)
    return path


def write_text(path: Path, text: str) -> Path:
    return write_whole(path, lambda partial: partial.write_text(text))


def write_json(path: Path, content: Any, indent: Optional[int] = 1) -> Path:
    """Strict JSON (non-finite numbers as null), written whole."""
    return write_text(path, json.dumps(finite(content), indent=indent, allow_nan=False) + "\n")
