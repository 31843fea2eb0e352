"""`commsched-train` starts every rank of its node itself, before any of them imports torch.

Lightning's launcher starts ranks 1..N-1 when `trainer.fit` begins, after rank 0 has imported torch
and Lightning (about 4 s here); each of them then imports the same for another 4 s while rank 0
waits at the process group. Started together instead, the ranks import side by side. Lightning
takes processes that arrive with `LOCAL_RANK` set as created outside it (as under `torchrun`) and
launches nothing more, so this module owns them: it waits for all of them, passes SIGTERM on,
and ends the others when one fails and they have not followed within a grace period (a peer
waiting for a dead rank would otherwise wait for the collective timeout).

It starts a node's processes whenever it runs several and nothing started them for it: one node,
or one node of several launched per node the way Lightning documents (`MASTER_ADDR`, `MASTER_PORT`,
`NODE_RANK` set on each node, as `commsched-cluster` does). There Lightning would re-launch this
process's command line for the other local ranks, and `python -c` cannot be re-launched. Under a
launcher that starts every rank itself (`torchrun`, SLURM, MPI), or with one process, it starts the
one process and Lightning does the rest.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from commsched.errors import CommSchedConfigError

RANK_ENTRY = "import commsched_cli; commsched_cli.run_rank()"
"""What each rank runs: the console module first, so that Ctrl-C while torch imports ends it quietly."""
_SET_BY_A_LAUNCHER = (
    "LOCAL_RANK",
    "RANK",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "JSM_NAMESPACE_SIZE",
)
"""Set where every rank was started by a launcher (torchrun, SLURM, Open MPI, MPICH/Intel MPI, PMIx,
LSF). `NODE_RANK` and `WORLD_SIZE` are not among them: Lightning's own multi-node launch sets them on
each node and expects the script to start that node's ranks."""
GRACE_S = 30.0
"""How long the others may take to end by themselves after a rank failed (they report the dead peer)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_environments(devices: int, num_nodes: int) -> list[Optional[dict[str, str]]]:
    """One environment per process to start; [None]: one process, Lightning launches the rest."""
    if devices <= 1 or any(name in os.environ for name in _SET_BY_A_LAUNCHER):
        return [None]
    node_rank = os.environ.get("NODE_RANK", "0")
    if num_nodes == 1:
        if node_rank != "0":  # every node would train a run of its own, and each would end "successfully"
            raise CommSchedConfigError(
                f"commsched: NODE_RANK={node_rank} is set but trainer.num_nodes=1: set trainer.num_nodes to the "
                "number of nodes (commsched-cluster --nodes N needs trainer.num_nodes=N)"
            )
        shared = {
            **os.environ,
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": str(_free_port()),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(devices),
        }
    else:
        missing = [name for name in ("NODE_RANK", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise CommSchedConfigError(
                f"commsched: trainer.num_nodes={num_nodes} needs {' and '.join(missing)} set on every node, and "
                "MASTER_ADDR (node 0's address) on the others, as Lightning's multi-node launch does; "
                "commsched-cluster sets them, torchrun and SLURM start the ranks themselves"
            )
        shared = {
            **os.environ,
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "WORLD_SIZE": str(devices * num_nodes),
        }
    return [{**shared, "LOCAL_RANK": str(rank)} for rank in range(devices)]


class Ranks:
    """The processes of one run on this node; rank 0 first."""

    def __init__(self, config_file: Path, out: Path, devices: int, num_nodes: int) -> None:
        command = [sys.executable, "-c", RANK_ENTRY, str(config_file), str(out)]
        self.processes = [subprocess.Popen(command, env=env) for env in rank_environments(devices, num_nodes)]

    def send(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def wait(self) -> int:
        """Rank 0's exit status if it failed, else the first failure's, else 0, once all ended."""
        failed_at: Optional[float] = None
        while any(process.poll() is None for process in self.processes):
            if failed_at is None and any(process.poll() not in (None, 0) for process in self.processes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                self.send(signal.SIGKILL)
            time.sleep(0.1)
        codes = [process.returncode for process in self.processes]
        return codes[0] or next((code for code in codes if code), 0)
