"""An emulated slow network on one machine: a fresh network namespace whose loopback is rate-limited,
created for one command and always removed afterwards, also on Ctrl-C or error.

Workers started inside talk over 127.0.0.1 of that namespace only. Needs root and iproute2.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional, Sequence

from commsched.rates import parse_rate

log = logging.getLogger(__name__)
PREFIX = "commsched-"
"""Every namespace commsched makes is named `commsched-<pid of its maker>-...`."""
NETNS_DIR = Path("/run/netns")

CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
"""Bits of the capability sets: links and qdiscs need the first; `ip netns add` mounts, which needs the second."""


def missing_capabilities() -> list[str]:
    """The capabilities this process lacks for namespaces and tc: root in a default container has neither."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return [] if os.geteuid() == 0 else ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]
    effective = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("CapEff:")), 0)
    return [
        name
        for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
        if not effective >> bit & 1
    ]


def unavailable_reason() -> Optional[str]:
    """Why a rate-limited namespace cannot be made here, or None if it can. The capabilities are
    checked, not the uid: root in a container without them is refused by `ip` and `mount`."""
    if os.geteuid() != 0:
        return "emulating a slow link needs root (network namespaces and tc)"
    missing = missing_capabilities()
    if missing:
        return f"emulating a slow link needs {' and '.join(missing)}, which this process lacks (a default container)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulating a slow link needs iproute2 ({', '.join(missing)} not found)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def run_in_namespace(rate: str, argv: Sequence[str], burst: str = "256kb") -> int:
    """Run `argv` inside a new namespace whose loopback is limited to `rate` ('none': unlimited).

    Returns the command's exit code. The namespace is deleted in every case; SIGTERM is turned into
    an exception so that `finally` runs, SIGINT reaches the child (same process group) and us."""
    if rate != "none":
        parse_rate(rate)  # a bad rate fails here, before anything is created
    reason = unavailable_reason()
    if reason is not None:
        raise PermissionError(reason)
    remove_orphans()
    name = new_name()
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    child: Optional[subprocess.Popen] = None
    try:
        _ip("netns", "add", name)
        # burst must exceed the MTU, or messages larger than the bucket stall
        _ip("-n", name, "link", "set", "lo", "mtu", "9000", "up")
        if rate != "none":
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    name,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "lo",
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    burst,
                    "latency",
                    "50ms",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        # c10d warns on every connection that the namespace's hostname does not resolve; it is harmless
        env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ}
        child = subprocess.Popen(["ip", "netns", "exec", name, *argv], env=env)
        return child.wait()
    except BaseException:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        raise
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        signal.signal(signal.SIGTERM, previous)


def namespaces() -> list[str]:
    """Names of the namespaces commsched created that still exist (none once every run has ended)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX)]


def new_name(suffix: str = "") -> str:
    """A namespace name that says which process made it, so that a later run can tell an orphan."""
    return f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}{suffix}"


def _orphaned(name: str) -> bool:
    """True where the process that made `name` is gone: killed with SIGKILL (or the machine's
    restart), nothing could remove its namespaces. A live process with that pid that started after
    the namespace existed is a reuse of the number, not its maker."""
    try:
        pid = int(name[len(PREFIX) :].split("-", 1)[0])
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    try:
        return os.stat(f"/proc/{pid}").st_mtime > os.stat(NETNS_DIR / name).st_mtime + 1.0
    except OSError:
        return False


def remove_orphans() -> list[str]:
    """Delete the namespaces of runs that were killed before they could clean up; return their names.
    Every run calls this before it makes its own, so a SIGKILL leaves litter only until the next run."""
    orphans = [name for name in namespaces() if _orphaned(name)]
    for name in orphans:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if orphans:
        log.warning(
            "commsched: removed %d network namespace(s) left by a run that was killed: %s",
            len(orphans),
            ", ".join(orphans),
        )
    return orphans


def _raise_exit(signum: int, _frame: object) -> None:
    sys.exit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m commsched.cluster.netns RATE COMMAND...`: any command (e.g. commsched-train) over an emulated link."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print(
            "usage: python -m commsched.cluster.netns RATE COMMAND...   (RATE: e.g. 1gbit, 200mbit, none)",
            file=sys.stderr,
        )
        return 2
    try:
        return run_in_namespace(args[0], args[1:])
    except (PermissionError, ValueError) as error:
        print(f"commsched.cluster.netns: {error}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
