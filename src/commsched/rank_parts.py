"""Each rank's communication state in a file of its own beside the checkpoint.

The state that differs between ranks (top-k's residuals and velocities, PowerSGD's errors, DeFT's
delayed gradients) is gradient-sized per rank. Gathered to rank 0 and pickled into the checkpoint, it
would make rank 0 hold W copies in host memory and the file grow with W. Instead each rank writes its
own part, at the same time, into a folder named after the checkpoint and this save
(``last.ckpt`` -> ``last.ckpt.commsched/<save>/rank3.pt``, each file written whole: beside its final
name, then renamed); the checkpoint keeps only which folder and how many ranks wrote (`PARTS_KEY`).
A save never overwrites the parts an earlier checkpoint of the same name reads: a run killed between
its ranks' parts and rank 0's checkpoint leaves the old checkpoint with its own parts, and the older
saves' folders go once the new checkpoint is written (`keep_only`).

A resume reads its own rank's part; one at another world size reads the parts one at a time
(re-sharding sums them). A part that is missing is refused on every rank together, with the path it
was looked for at. A checkpoint given as a URL (fsspec: ``s3://...``) keeps the gathered form, which
every filesystem can hold.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from commsched.errors import CommSchedConfigError

PARTS_KEY = "per_rank_parts"
"""In the checkpoint's communication state: ``{"folder": path beside the checkpoint, "world_size": W}``."""
SUFFIX = ".commsched"


def local(checkpoint_path: Any) -> bool:
    """A path on this machine's filesystem (not a URL), where every rank can write beside the checkpoint."""
    return "://" not in str(checkpoint_path)


def parts_folder(checkpoint_path: Any) -> Path:
    """Where every save of the checkpoint at `checkpoint_path` keeps its parts, one folder per save."""
    return Path(checkpoint_path).with_name(Path(checkpoint_path).name + SUFFIX)


def _device() -> torch.device:
    """Where the default group's collectives take their tensors (NCCL: the current GPU only)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def write(checkpoint_path: Any, mine: Any, world_size: int) -> Optional[dict[str, Any]]:
    """Collective (every rank, same point): this rank's part (its tensors on the CPU) written beside
    `checkpoint_path`, in a folder of this save's own; what the checkpoint records (None where no rank
    holds per-rank state: nothing is written)."""
    agreed = torch.tensor([1.0 if mine else 0.0, float(secrets.randbits(24)) if dist.get_rank() == 0 else 0.0])
    agreed = agreed.to(_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # anyone holds state; rank 0's name for this save
    held, token = agreed.tolist()
    if not held:
        return None
    folder = parts_folder(checkpoint_path) / f"save-{int(token):07d}"
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"rank{dist.get_rank()}.pt"
    partial = final.with_name(f".partial-{os.getpid()}-{final.name}")
    try:
        torch.save(mine, partial)
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return {"folder": f"{parts_folder(checkpoint_path).name}/{folder.name}", "world_size": world_size}


def keep_only(checkpoint_path: Any, parts: Optional[dict[str, Any]]) -> None:
    """Once the checkpoint naming `parts` is written (rank 0): earlier saves' parts of the same name go."""
    if not local(checkpoint_path):
        return
    kept = Path(parts["folder"]).name if parts else None
    folder = parts_folder(checkpoint_path)
    for old in folder.glob("save-*") if folder.is_dir() else ():
        if old.name != kept:
            shutil.rmtree(old, ignore_errors=True)
    if kept is None:
        shutil.rmtree(folder, ignore_errors=True)


def discard(checkpoint_path: Any, entry: Optional[dict[str, Any]]) -> None:
    """A save that failed after this rank wrote its part (a peer died, the disk filled): the part goes, and
    the folders it leaves empty, so nothing is left beside a checkpoint that was not written."""
    parts = (entry or {}).get(PARTS_KEY)
    if not parts or not local(checkpoint_path):
        return
    save = parts_folder(checkpoint_path).parent / parts["folder"]
    (save / f"rank{dist.get_rank()}.pt").unlink(missing_ok=True)
    for folder in (save, save.parent):
        try:
            folder.rmdir()  # only if empty: other ranks' parts, or earlier saves, stay
        except OSError:
            break


def _path(checkpoint_path: Any, parts: dict[str, Any], rank: int) -> Path:
    """A link to a checkpoint (ModelCheckpoint's ``save_last="link"``) reads its target's parts."""
    return Path(checkpoint_path).resolve().parent / parts["folder"] / f"rank{rank}.pt"


def refuse_missing(checkpoint_path: Any, parts: dict[str, Any], rank: int) -> None:
    """Collective where the process group exists: every rank refuses together when any rank's part is
    missing (one rank refusing alone would leave the others waiting for it until the timeout)."""
    missing = torch.zeros(parts["world_size"])
    missing[rank] = 0.0 if _path(checkpoint_path, parts, rank).is_file() else 1.0
    if dist.is_available() and dist.is_initialized():
        missing = missing.to(_device())
        dist.all_reduce(missing)
    gone = [r for r, flag in enumerate(missing.tolist()) if flag > 0]
    if gone:
        wanted = ", ".join(f"rank {r}: {_path(checkpoint_path, parts, r)}" for r in gone)
        raise CommSchedConfigError(
            f"commsched: the checkpoint {checkpoint_path} was written by {parts['world_size']} processes, each "
            f"writing its communication state beside it, and a part is missing ({wanted}). Copy the "
            f"checkpoint's {Path(parts['folder']).parent}/ folder with it, or load only the weights "
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
