"""`commsched-bench`: ddp, wfbp and dear side by side on N local CPU workers, over the unlimited
loopback or an emulated slow link, with each schedule's theoretical best and the simulator's
prediction for the same measured components.

    commsched-bench                                   # small_cnn, 2 workers, unlimited
    commsched-bench link.rate=1gbit models=[small_cnn,resnet18] steps=20

The emulated link is a network namespace made for the run and always removed (root + iproute2;
without them the benchmark says so and runs unlimited). Writes results.json, bench.csv and
bench.png to the run directory and prints the table.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from commsched import netns
from commsched.bench.config import register_bench_config, validate_bench

register_bench_config()

COLUMNS = ("schedule", "step_ms", "cpu_ms", "samples_per_s", "speedup_vs_ddp", "theoretical_ms", "measured_over_theoretical",
           "predicted_ms", "prediction_error")


def run_worker(spec_file: Path, out: Path, rate: str, console: Console) -> str:
    """Runs the worker, in a rate-limited namespace when asked and possible; returns the rate used."""
    argv = [sys.executable, "-m", "commsched.bench.worker", str(spec_file), str(out)]
    if rate != "none":
        reason = netns.unavailable_reason()
        if reason is None:
            code = netns.run_in_namespace(rate, argv)
            if code != 0:
                raise SystemExit(f"commsched-bench: the benchmark workers failed (exit code {code}); output above")
            return rate
        console.print(f"[yellow]commsched-bench: {reason}; running on the unlimited loopback instead of {rate}[/yellow]")
    code = subprocess.run(argv).returncode
    if code != 0:
        raise SystemExit(f"commsched-bench: the benchmark workers failed (exit code {code}); output above")
    return "none"


def print_results(results: list[dict], cfg: Any, rate: str, console: Console) -> None:
    for result in results:
        parts = "  ".join(f"{k} {v:.1f}" for k, v in result["components_ms"].items())
        console.print(f"[bold]{result['model']}[/bold]: {result['gradient_mb']:.1f} MB of gradients in "
                      f"{result['buckets']} buckets, {cfg.devices} workers, batch {cfg.batch_size}/worker, "
                      f"link {rate}; components (ms): {parts}")
        table = Table()
        for column in ("schedule", "step (ms)", "CPU (ms)", "samples/s", "vs ddp", "theoretical best (ms)", "measured / best",
                       "simulated (ms)", "sim error"):
            table.add_column(column, justify="right")
        for row in result["rows"]:
            vs = f"{row['speedup_vs_ddp']:.3f}" if row["speedup_vs_ddp"] is not None else "-"
            table.add_row(row["schedule"], f"{row['step_ms']:.1f}", f"{row['cpu_ms']:.1f}", f"{row['samples_per_s']:.1f}", vs,
                          f"{row['theoretical_ms']:.1f}", f"{row['measured_over_theoretical']:.2f}",
                          f"{row['predicted_ms']:.1f}", f"{row['prediction_error']:+.1%}")
        console.print(table)
        warn_if_noisy(result, console)


ROUNDS_AGREE = 0.05  # rounds further apart than this are too noisy to trust


def warn_if_noisy(result: dict, console: Console) -> None:
    for row in result["rows"]:
        times = row.get("rounds_ms", [])
        if len(times) > 1 and max(times) / min(times) - 1 > ROUNDS_AGREE:
            console.print(f"[yellow]commsched-bench: the {len(times)} rounds of {row['schedule']} on {result['model']} "
                          f"disagree by {max(times) / min(times) - 1:.0%} ({', '.join(f'{t:.0f}' for t in times)} ms): "
                          "too few steps to trust; raise steps= or rounds=[/yellow]")


def plot(results: list[dict], rate: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results):
        names = [row["schedule"] for row in result["rows"]]
        x = range(len(names))
        for offset, key, label in ((-0.27, "step_ms", "measured"), (0.0, "predicted_ms", "simulated"),
                                   (0.27, "theoretical_ms", "theoretical best")):
            ax.bar([i + offset for i in x], [row[key] for row in result["rows"]], width=0.27, label=label)
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{result['model']}, link {rate}")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@hydra.main(version_base=None, config_path="../conf", config_name="bench")
def main(cfg: DictConfig) -> None:
    validate_bench(cfg)
    out = Path(HydraConfig.get().runtime.output_dir)
    console = Console(width=140)
    spec = OmegaConf.to_container(cfg, resolve=True)
    spec_file = out / "bench.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    rate = run_worker(spec_file, out, cfg.link.rate, console)
    results = json.loads((out / "results.json").read_text())
    print_results(results, cfg, rate, console)
    with (out / "bench.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["model", "link_rate", *COLUMNS])
        writer.writeheader()
        for result in results:
            for row in result["rows"]:
                writer.writerow({"model": result["model"], "link_rate": rate, **{k: row[k] for k in COLUMNS}})
    plot(results, rate, out / "bench.png")
    console.print(f"wrote {out}/results.json, bench.csv, bench.png")


if __name__ == "__main__":
    main()
