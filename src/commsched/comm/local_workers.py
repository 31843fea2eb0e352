"""Start N local worker processes joined in a gloo process group over 127.0.0.1 (the probe's workers;
training runs start theirs in `commsched.cli.ranks`)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def end_process_group() -> None:
    """Destroy the default process group, if any, before the interpreter exits: a gloo group left to
    interpreter teardown can abort the process ("terminate called without an active exception", exit
    code -6) after a run that succeeded (pytorch/pytorch#190489). Lightning does not destroy it."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_workers(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> None:
    """Run `fn(rank, *args)` in `world` spawned processes; an error in any of them is raised here."""
    mp.start_processes(_entry, args=(world, free_port(), fn, args, timeout_s), nprocs=world, start_method="spawn")


def _node_entry(local: int, per_node: int, fn: Callable[..., Any], args: tuple, timeout_s: float) -> None:
    """One worker of a node of a cluster: its global rank from the node's NODE_RANK (commsched-cluster)."""
    nodes = int(os.environ["COMMSCHED_NUM_NODES"])
    rank = int(os.environ["NODE_RANK"]) * per_node + local
    dist.init_process_group("gloo", rank=rank, world_size=nodes * per_node, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_node_workers(per_node: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> None:
    """This node's `per_node` workers of a cluster run (MASTER_ADDR/PORT and NODE_RANK from the environment)."""
    mp.start_processes(_node_entry, args=(per_node, fn, args, timeout_s), nprocs=per_node, start_method="spawn")
