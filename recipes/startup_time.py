"""How long `commsched-train` takes before training starts: the wall time of a one-step run of the
default configuration (compose, validate, start every rank, import, build, link, one step, save).

    .venv/bin/python recipes/startup_time.py [runs=3]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def one_run(directory: Path) -> float:
    started = time.perf_counter()
    subprocess.run(
        [
            str(BIN / "commsched-train"),
            f"hydra.run.dir={directory}",
            "trainer.max_steps=1",
            "trainer.enable_progress_bar=false",
        ],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as tmp:
        seconds = [one_run(Path(tmp) / f"run{i}") for i in range(runs)]
    print(
        f"commsched-train, default run of one step: {statistics.median(seconds):.1f} s wall "
        f"(median of {runs}: {', '.join(f'{s:.1f}' for s in seconds)})"
    )


if __name__ == "__main__":
    main()
