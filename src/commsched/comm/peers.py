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
"""Every rank's (where, pid), this rank's included; empty before `learn` (or without a process group).
`where` names the host and its process-id namespace: two containers on one host that share a host
name do not see each other's processes, and are not the same place."""


def _where() -> str:
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (macOS): the host alone
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


def learn(group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective (every rank, at the same point of setup): gather every rank's place and process id."""
    if not dist.is_initialized():
        return
    everyone: list[Optional[tuple[str, int]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (_where(), os.getpid()), group=group)
    _peers.clear()
    _peers.update({rank: peer for rank, peer in enumerate(everyone) if peer is not None})


def _exited(pid: int) -> bool:
    """The process has exited, or is a zombie its parent has not reaped yet."""
    if not Path("/proc/self").exists():  # no /proc: ask the kernel whether the process exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "")
    return state in ("Z", "X")


def gone() -> list[tuple[int, int]]:
    """(rank, pid) of every other rank in this place whose process has exited."""
    here = _where()
    return [
        (rank, pid)
        for rank, (where, pid) in sorted(_peers.items())
        if where == here and pid != os.getpid() and _exited(pid)
    ]


def describe_gone() -> Optional[str]:
    """'rank 1 (process 4242) has exited' (or several), None when no rank here is known gone."""
    dead = gone()
    if not dead:
        return None
    names = ", ".join(f"rank {rank} (process {pid})" for rank, pid in dead)
    return f"{names} {'has' if len(dead) == 1 else 'have'} exited"
