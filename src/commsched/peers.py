"""Who the other ranks are (host and process id), learnt once at setup, so that a failed collective
can name the rank that is gone instead of saying only that "a peer probably died".

The backend's own error names an address and a port at best. A rank on this machine whose process
has exited (or is a zombie its parent has not reaped yet) is certainly gone; a rank on another
machine cannot be looked at from here, and is not named.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

import torch.distributed as dist

_peers: dict[int, tuple[str, int]] = {}
"""Every rank's (host, pid), this rank's included; empty before `learn` (or without a process group)."""


def learn(group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective (every rank, at the same point of setup): gather every rank's host and process id."""
    if not dist.is_initialized():
        return
    everyone: list[Optional[tuple[str, int]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()), group=group)
    _peers.clear()
    _peers.update({rank: peer for rank, peer in enumerate(everyone) if peer is not None})


def _exited(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        state = next((line.split()[1] for line in status.read_text().splitlines() if line.startswith("State:")), "")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:  # no /proc here: ask the kernel whether the process exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return state in ("Z", "X")


def gone() -> list[tuple[int, int]]:
    """(rank, pid) of every other rank on this machine whose process has exited."""
    here = socket.gethostname()
    return [(rank, pid) for rank, (host, pid) in sorted(_peers.items()) if host == here and pid != os.getpid() and _exited(pid)]


def describe_gone() -> Optional[str]:
    """'rank 1 (process 4242) has exited' (or several), None when no rank on this machine is known gone."""
    dead = gone()
    if not dead:
        return None
    names = ", ".join(f"rank {rank} (process {pid})" for rank, pid in dead)
    return f"{names} {'has' if len(dead) == 1 else 'have'} exited"
