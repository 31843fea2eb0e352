"""Run one command on every node of an emulated cluster, the way a cluster's launcher would.

Each node's command gets the environment Lightning's own multi-node launch reads (`MASTER_ADDR`
= node 0's primary address, `MASTER_PORT`, `NODE_RANK`), so a plain script with
``Trainer(num_nodes=N, devices=G)`` runs unchanged; Lightning then starts the node's G processes.
The primary interface is what gloo and NCCL use by default (`GLOO_SOCKET_IFNAME`,
`NCCL_SOCKET_IFNAME`); `COMMSCHED_PRIMARY_IFNAME` / `COMMSCHED_SECONDARY_IFNAME` name the links for
strategies that open a group on a given interface. `on_host=True` runs the nodes as plain processes of
this machine over its unlimited loopback, with the same environment and the same handling: what ranks
that cannot be one node's devices need (several ranks sharing one GPU: Lightning gives one node's
ranks one device each). Every line a node prints is prefixed with its
rank; the exit status is the worst of the nodes', and one line on stderr says which node's command
failed with what status (a failing command may print nothing at all); a node that fails ends the
others after `grace_s` (they would otherwise wait for it until the process-group timeout). The
network is removed on success, on error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Optional, Sequence

from commsched.cluster.network import Network
from commsched.cluster.spec import LOOPBACK, PRIMARY_IFNAME, SECONDARY_IFNAME, ClusterSpec
from commsched.options.links import SECONDARY_IFNAME_ENV


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class OnHost:
    """The nodes' "network" when they run on this machine's loopback: nothing to build or remove."""

    def create(self) -> None:
        pass

    def remove(self) -> None:
        pass

    def command_in(self, node: int, argv: Sequence[str]) -> list[str]:
        return list(argv)


def node_environment(spec: ClusterSpec, node: int, on_host: bool = False) -> dict[str, str]:
    interface = LOOPBACK if on_host else PRIMARY_IFNAME
    env = {
        "MASTER_ADDR": "127.0.0.1" if on_host else spec.address(0),
        "MASTER_PORT": str(spec.master_port),
        "NODE_RANK": str(node),
        "COMMSCHED_NUM_NODES": str(spec.nodes),
        "COMMSCHED_WORKERS_PER_NODE": str(spec.workers_per_node),
        "COMMSCHED_PRIMARY_IFNAME": interface,
        "GLOO_SOCKET_IFNAME": interface,
        "NCCL_SOCKET_IFNAME": interface,
        "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10d warns on every connection that the shared hostname does not resolve
        # all nodes share this machine's cores: each process gets its share, not a node's worth
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // spec.world_size)),
    }
    if spec.secondary_rate is not None and not on_host:
        env[SECONDARY_IFNAME_ENV] = SECONDARY_IFNAME
    return env


def _pump(stream: IO[str], prefix: str, lines: list[int], node: int) -> None:
    for line in stream:
        sys.stdout.write(f"{prefix}{line}")
        sys.stdout.flush()
        lines[node] += 1


def _exit_code(code: Optional[int]) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else code  # killed by signal n: 128 + n, as a shell reports it


def run_on_nodes(spec: ClusterSpec, argv: Sequence[str], grace_s: float = 60.0, on_host: bool = False) -> int:
    """Build the cluster, run `argv` on every node, remove the cluster; the worst exit status.
    `on_host`: the nodes are processes on this machine's loopback (no namespace; the rates unused)."""
    spec.check()
    network = OnHost() if on_host else Network(spec)
    previous = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGINT)}
    processes: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    lines = [0] * spec.nodes
    try:
        network.create()
        for node in range(spec.nodes):
            env = {**os.environ, **node_environment(spec, node, on_host)}
            process = subprocess.Popen(
                network.command_in(node, argv),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            processes.append(process)
            pumps.append(
                threading.Thread(target=_pump, args=(process.stdout, f"[node {node}] ", lines, node), daemon=True)
            )
            pumps[-1].start()
        codes, ended_by_us = _wait(processes, grace_s)
        for pump in pumps:  # the nodes' last lines before the verdict (a child left holding the pipe is not waited for)
            pump.join(timeout=5)
        failure = failure_line(codes, ended_by_us, lines, grace_s)
        if failure:
            print(failure, file=sys.stderr, flush=True)
        return max((_exit_code(code) for node, code in enumerate(codes) if node not in ended_by_us), default=0)
    except Interrupted as interrupted:
        _stop(processes, interrupted.signum)
        return 128 + interrupted.signum
    except BaseException:
        _stop(processes, signal.SIGTERM)
        raise
    finally:
        network.remove()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _raise(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def failure_line(codes: list[Optional[int]], ended_by_us: set[int], lines: list[int], grace_s: float) -> str:
    """One line naming each node whose command failed by itself, its exit status and where its
    output is ("" when none failed): the command's own output, if any, is above, prefixed."""
    failed = [node for node, code in enumerate(codes) if node not in ended_by_us and _exit_code(code) != 0]
    if not failed:
        return ""
    said = []
    for node in failed:
        code = codes[node]
        status = (
            f"exit code {_exit_code(code)}, killed by {signal.Signals(-code).name}"
            if code is not None and code < 0 and -code in signal.valid_signals()
            else f"exit code {_exit_code(code)}"
        )
        where = f"its output is above, on the lines starting [node {node}]" if lines[node] else "it printed nothing"
        said.append(f"node {node} ({status}; {where})")
    others = sorted(ended_by_us)
    stopped = (
        f"; {'node' if len(others) == 1 else 'nodes'} {', '.join(map(str, others))} "
        f"{'was' if len(others) == 1 else 'were'} stopped after the {grace_s:g} s grace (--grace)"
        if others
        else ""
    )
    return f"commsched-cluster: the command failed on {' and '.join(said)}{stopped}"


def _wait(processes: list[subprocess.Popen], grace_s: float) -> tuple[list[Optional[int]], set[int]]:
    """Every node's return code, and the nodes ended after another failed (theirs are not failures)."""
    failed_at: Optional[float] = None
    ended_by_us: set[int] = set()
    while any(p.poll() is None for p in processes):
        if failed_at is None and any(p.poll() not in (None, 0) for p in processes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            ended_by_us = {i for i, p in enumerate(processes) if p.poll() is None}
            _stop(processes, signal.SIGTERM)
            break
        time.sleep(0.2)
    for p in processes:
        p.wait()
    return [p.returncode for p in processes], ended_by_us


def _stop(processes: list[subprocess.Popen], signum: int) -> None:
    """Signal every node's whole process group (Lightning's workers too), then kill what is left after
    15 s. A second Ctrl-C or SIGTERM meanwhile kills at once: it must not cut the stop short, or the
    workers (a hung collective ignores SIGTERM) would outlive their network."""
    hurry = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: hurry.set())
    for p in processes:
        if p.poll() is None:
            os.killpg(p.pid, signum)
    deadline = time.monotonic() + 15
    for p in processes:
        while p.poll() is None and time.monotonic() < deadline and not hurry.is_set():
            time.sleep(0.05)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
