"""Collect a multi-run's summaries into sweep.csv, a rich console table and sweep.png (samples/s).

Runs by itself at the end of every `commsched-train -m ...` (a Hydra callback), or again later:
`python -m commsched.cli.sweep multirun/2026-11-22/10-00-00`.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from commsched.lab import has_lab, plot_skipped

COLUMNS = (
    "run",
    "schedule",
    "model",
    "data",
    "bucket_cap_mb",
    "world_size",
    "samples_per_s",
    "step_ms",
    "exposed_comm_ms",
    "train_loss",
    "val_acc",
    "val_ppl",
    "overrides",
)
TABLE_COLUMNS = ("run", "samples_per_s", "step_ms", "exposed_comm_ms", "train_loss", "val_acc", "val_ppl")


def read_summaries(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every finished job's summary, in job order, each labelled by the overrides that vary across jobs."""
    jobs = sorted(sweep_dir.glob("*/summary.json"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    rows = [json.loads(p.read_text()) for p in jobs]
    parsed = [dict(item.split("=", 1) for item in row["overrides"].split() if "=" in item) for row in rows]
    varying = [k for k in dict.fromkeys(k for p in parsed for k in p) if len({p.get(k) for p in parsed}) > 1]
    for row, overrides in zip(rows, parsed):
        row["run"] = " ".join(f"{k}={overrides.get(k, '-')}" for k in varying) or row["schedule"]
    return rows


def write_sweep_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return "" if value is None else str(value)


def print_sweep_table(rows: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    shown = [c for c in TABLE_COLUMNS if any(row.get(c) is not None for row in rows)]
    for column in shown:
        table.add_column(
            column.replace("_", " "), justify="left" if column == "run" else "right", no_wrap=column == "run"
        )
    for row in rows:
        table.add_row(*(_cell(row.get(c)) for c in shown))
    Console(width=max(Console().width, 120)).print(table)


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["run"] for row in rows]
    colours = {"ddp": "tab:gray", "wfbp": "tab:blue", "dear": "tab:orange", "deft": "tab:green"}
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    ax.bar(
        range(len(rows)),
        [row["samples_per_s"] for row in rows],
        color=[colours.get(r["schedule"], "tab:green") for r in rows],
    )
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("samples/s (all workers)")
    ax.set_title("commsched sweep: throughput per run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = read_summaries(sweep_dir)
    if not rows:
        print(f"commsched: no finished runs (*/summary.json) in {sweep_dir}", file=sys.stderr)
        return rows
    write_sweep_csv(rows, sweep_dir / "sweep.csv")
    if has_lab():
        plot_sweep(rows, sweep_dir / "sweep.png")
        print_sweep_table(rows, f"{sweep_dir}: sweep.csv, sweep.png")
    else:
        print(plot_skipped(str(sweep_dir / "sweep.png")), file=sys.stderr)
        print_sweep_table(rows, f"{sweep_dir}: sweep.csv")
    return rows


class CollectSweep(Callback):
    """Hydra callback: collect the sweep once every job of a multi-run has finished."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        collect(Path(config.hydra.sweep.dir))


if __name__ == "__main__":
    collect(Path(sys.argv[1]))
