"""Each rank's communication state in a file of its own beside the checkpoint.

The state that differs between ranks (top-k's residuals and velocities, PowerSGD's errors, DeFT's
delayed gradients) is gradient-sized per rank. Gathered to rank 0 and pickled into the checkpoint, it
would make rank 0 hold W copies in host memory and the file grow with W. Instead each rank writes its
own part, at the same time, into a folder named after the checkpoint (``last.ckpt`` ->
``last.ckpt.commsched/rank3.pt``, written whole: beside its final name, then renamed); the checkpoint
keeps only which folder and how many ranks wrote (`PARTS_KEY`). A resume reads its own rank's part;
one at another world size reads the parts one at a time (re-sharding sums them). A part that is missing
is refused with the path it was looked for at. A checkpoint given as a URL (fsspec: ``s3://...``) keeps
the gathered form, which every filesystem can hold.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from commsched.errors import CommSchedConfigError
from commsched.run_files import write_whole

PARTS_KEY = "per_rank_parts"
"""In the checkpoint's communication state: ``{"folder": name beside the checkpoint, "world_size": W}``."""
SUFFIX = ".commsched"


def local(checkpoint_path: Any) -> bool:
    """A path on this machine's filesystem (not a URL), where every rank can write beside the checkpoint."""
    return "://" not in str(checkpoint_path)


def parts_folder(checkpoint_path: Any) -> Path:
    return Path(checkpoint_path).with_name(Path(checkpoint_path).name + SUFFIX)


def write(checkpoint_path: Any, mine: Any, world_size: int) -> Optional[dict[str, Any]]:
    """Collective (every rank, same point): this rank's part (its tensors on the CPU) written beside
    `checkpoint_path`; what the checkpoint records (None where no rank holds per-rank state: nothing is
    written)."""
    held = torch.tensor([1.0 if mine else 0.0])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if not held.item():
        return None
    folder = parts_folder(checkpoint_path)
    write_whole(folder / f"rank{dist.get_rank()}.pt", lambda partial: torch.save(mine, partial))
    return {"folder": folder.name, "world_size": world_size}


def _path(checkpoint_path: Any, parts: dict[str, Any], rank: int) -> Path:
    """A link to a checkpoint (ModelCheckpoint's ``save_last="link"``) reads its target's parts."""
    return Path(checkpoint_path).resolve().with_name(parts["folder"]) / f"rank{rank}.pt"


def refuse_missing(checkpoint_path: Any, parts: dict[str, Any], rank: int) -> None:
    """Collective where the process group exists: every rank refuses together when any rank's part is
    missing (one rank refusing alone would leave the others waiting for it until the timeout)."""
    missing = torch.zeros(parts["world_size"])
    missing[rank] = 0.0 if _path(checkpoint_path, parts, rank).is_file() else 1.0
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(missing)
    gone = [r for r in range(parts["world_size"]) if missing[r] > 0]
    if gone:
        wanted = ", ".join(f"rank {r}: {_path(checkpoint_path, parts, r)}" for r in gone)
        raise CommSchedConfigError(
            f"commsched: the checkpoint {checkpoint_path} was written by {parts['world_size']} processes, each "
            f"writing its communication state beside it, and a part is missing ({wanted}). Copy the "
            f"checkpoint's {parts['folder']}/ folder with it, or load only the weights "
            "(e.g. LightningModule.load_from_checkpoint)."
        )


def read(checkpoint_path: Any, parts: dict[str, Any], rank: int) -> Any:
    """Rank `rank`'s part of the checkpoint at `checkpoint_path` (`refuse_missing` first)."""
    path = _path(checkpoint_path, parts, rank)
    if not path.is_file():
        refuse_missing(checkpoint_path, parts, rank)
    return torch.load(path, map_location="cpu", weights_only=True)


def read_all(checkpoint_path: Any, parts: dict[str, Any]) -> Iterator[Any]:
    """Every rank's part, one at a time (a resume at another world size sums them)."""
    for rank in range(parts["world_size"]):
        yield read(checkpoint_path, parts, rank)


def remove(checkpoint_path: Any) -> None:
    """With the checkpoint (ModelCheckpoint keeping its best k removes the others)."""
    if local(checkpoint_path):
        shutil.rmtree(parts_folder(checkpoint_path), ignore_errors=True)
