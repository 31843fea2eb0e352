"""What an idle gloo process group costs its process: CPU time while nothing is sent.

    .venv/bin/python recipes/idle_groups.py 0 16 48

Two processes on the loopback make N extra groups each, sleep 5 s, and rank 0 prints the CPU time it
used meanwhile: each group keeps its connections and a thread polling them. This is why a stream
search releases the groups its kept configuration does not use.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from commsched.comm.local_workers import run_workers

IDLE_S = 5.0


def idle(rank: int, groups: int) -> None:
    made = [dist.new_group(backend="gloo") for _ in range(groups)]
    dist.barrier()
    start = time.process_time()
    time.sleep(IDLE_S)
    cpu = time.process_time() - start
    if rank == 0:
        print(f"{groups} idle groups: {cpu / IDLE_S * 1e3:.1f} ms of CPU per second", flush=True)
    for group in made:
        dist.destroy_process_group(group)


def main() -> None:
    for groups in [int(a) for a in sys.argv[1:]] or [0, 16, 48]:
        run_workers(2, idle, groups)


if __name__ == "__main__":
    main()
