"""Console entry points of commsched: they import the package without torch and Lightning (which
take about 6 s), so that ``--help`` and refused input answer at once; the work itself imports them."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def _run(module: str) -> Any:
    """Ctrl-C ends every command with one line and exit code 130: whatever it interrupted (an
    import, a worker, a network namespace) cleans up in its own `finally`, and a traceback of
    where the signal happened to land would say nothing to the user."""
    try:
        return importlib.import_module(module).main()
    except KeyboardInterrupt:
        print("commsched: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


def _hydra_syntax() -> None:
    """Refusals name settings as this command line spells them (``compression.density=0``)."""
    from commsched.errors import use_syntax

    use_syntax("hydra")


def train() -> Any:
    _hydra_syntax()
    return _run("commsched.cli.train")


def bench() -> Any:
    _hydra_syntax()
    return _run("commsched.bench.cli")


def probe() -> Any:
    return sys.exit(_run("commsched.profile.cli"))


def simulate() -> Any:
    return sys.exit(_run("commsched.sim.cli"))


def plan() -> Any:
    return sys.exit(_run("commsched.planning.cli"))


def cluster() -> Any:
    return sys.exit(_run("commsched.cluster.cli"))


def run_rank() -> None:
    """One rank of a `commsched-train` run (`commsched.cli.ranks` starts one per process). Until the run's
    own handling takes over, Ctrl-C ends it in one line: it may land while torch is importing."""
    import signal

    def interrupted_while_starting(signum: int, frame: Any) -> None:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print("commsched: interrupted before training started; nothing to save", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted_while_starting)
    _hydra_syntax()
    importlib.import_module("commsched.cli.run").main()


def bench_worker(argv: list[str]) -> None:
    """One rank of the benchmark's workers: `python -m commsched_cli bench-worker SPEC.json OUT_DIR`
    (Lightning starts the other ranks with the same command line). Ctrl-C ends it silently from its
    first instruction, torch's import included; the bench command itself says the one line."""
    import signal

    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
    importlib.import_module("commsched.bench.worker").main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] != ["bench-worker"] or len(sys.argv) != 4:
        sys.exit("usage: python -m commsched_cli bench-worker SPEC.json OUT_DIR")
    bench_worker(sys.argv[2:])
