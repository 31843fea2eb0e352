"""Running the benchmark's workers (in an emulated link when asked) and reporting what they measured:
the table, bench.csv, bench.png. Shared by `commsched-bench` and `make demo`."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from commsched.bench.config import gpu_layout
from commsched.cluster import netns

COLUMNS = (
    "schedule",
    "step_ms",
    "cpu_ms",
    "samples_per_s",
    "speedup_vs_ddp",
    "median_speedup_vs_ddp",
    "wire_mb",
    "local_mb",
    "theoretical_ms",
    "measured_over_theoretical",
    "predicted_ms",
    "prediction_error",
    "weights_vs_ddp",
    "chose",
    "deciding_steps",
)
ROUNDS_AGREE = 0.05  # rounds further apart than this are too noisy to trust


def run_benchmark(spec: dict, out: Path, console: Console) -> tuple[list[dict], str]:
    """Run the workers on `spec` (a validated bench config); the results and the link rate really used."""
    out.mkdir(parents=True, exist_ok=True)
    layout = gpu_layout(spec)
    spec = {**spec, "backend": "gloo" if layout else None}
    spec_file = out / "bench.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    argv = [sys.executable, "-m", "commsched_cli", "bench-worker", str(spec_file), str(out)]
    cluster = spec.get("cluster", {})
    if cluster.get("nodes"):
        return _run_in_cluster(spec, spec_file, argv, out, console)
    if layout == "nodes":
        return _run_as_host_nodes(spec, spec_file, argv, out, console)
    rate = spec["link"]["rate"]
    if rate != "none":
        reason = netns.unavailable_reason()
        if reason is None:
            _check(netns.run_in_namespace(rate, argv))
            return json.loads((out / "results.json").read_text()), rate
        console.print(f"[yellow]commsched: {reason}; running on the unlimited loopback instead of {rate}[/yellow]")
    _check(subprocess.run(argv).returncode)
    return json.loads((out / "results.json").read_text()), "none"


def _run_in_cluster(
    spec: dict, spec_file: Path, argv: list[str], out: Path, console: Console
) -> tuple[list[dict], str]:
    """Each node runs the worker with Trainer(num_nodes=N, devices=G): Lightning's own multi-node path."""
    from commsched.cluster.launch import run_on_nodes
    from commsched.cluster.spec import ClusterSpec

    c = spec["cluster"]
    cluster = ClusterSpec(
        c["nodes"], c["workers_per_node"], c["rate"], c.get("secondary_rate"), c.get("flow_rate")
    ).check()
    spec_file.write_text(json.dumps({**spec, "devices": c["workers_per_node"], "num_nodes": c["nodes"]}, indent=1))
    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"commsched: {reason}; cluster.nodes needs an emulated cluster")
    _check(run_on_nodes(cluster, argv))
    label = f"{c['nodes']}x{c['workers_per_node']} @ {c['rate']}" + (
        f", flows {c['flow_rate']}" if c.get("flow_rate") else ""
    )
    return json.loads((out / "results.json").read_text()), label


def _run_as_host_nodes(
    spec: dict, spec_file: Path, argv: list[str], out: Path, console: Console
) -> tuple[list[dict], str]:
    """Ranks sharing a GPU: each a node of its own with one device, on this machine's loopback."""
    from commsched.cluster.launch import run_on_nodes
    from commsched.cluster.spec import ClusterSpec
    from commsched.comm.local_workers import free_port

    ranks = spec["devices"]
    spec_file.write_text(json.dumps({**spec, "devices": 1, "num_nodes": ranks}, indent=1))
    console.print(
        f"commsched: {ranks} ranks, more than this machine's GPUs: each runs as a node of its own on the first GPU, "
        "every entry over gloo"
    )
    _check(run_on_nodes(ClusterSpec(ranks, 1, master_port=free_port()), argv, on_host=True))
    return json.loads((out / "results.json").read_text()), "none"


def _check(code: int) -> None:
    """A worker ended by Ctrl-C or SIGTERM is the user's interrupt, even when this process did not see
    the signal itself (it reaches the group's processes one by one): said as every command says it."""
    if code in (130, -signal.SIGINT, -signal.SIGTERM):
        raise KeyboardInterrupt
    if code != 0:
        raise SystemExit(f"commsched: the benchmark workers failed (exit code {code}); output above")


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COMPACT = {
    "step (ms)": "the median step after warm-up",
    "vs ddp": "speed-up over Lightning's ddp (above 1: faster)",
    "MB sent/step": "bytes this rank sent a step",
    "best possible (ms)": "the step its schedule allows for the measured compute and communication",
    "weights vs ddp": "largest difference of its final weights from ddp's",
}
"""The demo's columns and what each means (every column is in bench.csv)."""


def print_results(
    results: list[dict],
    spec: dict,
    rate: str,
    console: Console,
    compact: bool = False,
    more_steps: str = "raise steps= or rounds=",
) -> None:
    """The table of each model; `compact`: the columns that fit an 80-column terminal, with a legend."""
    for result in results:
        parts = "  ".join(f"{k} {v:.1f}" for k, v in result["components_ms"].items())
        console.print(
            f"[bold]{result['model']}[/bold]: {result['gradient_mb']:.1f} MB of gradients in "
            f"{result['buckets']} buckets, {_workers(spec)} workers, batch {spec['batch_size']}/worker, "
            f"link {rate}; components (ms): {parts}"
        )
        console.print(_compact_table(result) if compact else _full_table(result))
        chose = [
            f"{row['schedule']}: {row['chose']}, after {row['deciding_steps']} steps deciding"
            for row in result["rows"]
            if row.get("chose")
        ]
        if chose:
            console.print(
                "chosen by the runs themselves (those steps left out of the timing): " + "; ".join(chose) + "."
            )
        if compact:
            console.print("; ".join(f"{name}: {meaning}" for name, meaning in COMPACT.items()) + ".", style="dim")
        for number, decided in enumerate(
            result.get("deft", {}).get("rounds", []), 1
        ):  # each round measures and decides anew
            ratios = ", ".join(
                f"{d['ratio']:.3f} staleness {d['staleness']} ({'accepted' if d['accepted'] else 'rejected'})"
                for d in decided["preserver"]
            )
            console.print(
                f"deft, round {number}: {decided['plan']}; mu (secondary / primary all-reduce time) {decided['mu']:.2f}"
                + (f"; Preserver ratios {ratios}" if ratios else "; no Preserver")
            )
        for searched in result.get("deft", {}).get("streams", []):
            console.print(
                f"{searched['entry']}: the stream search chose {searched['chosen']} after {searched['trials']} "
                f"trials ({searched['chosen_ms']:.1f} ms/step when measured)"
            )
        if any(row["schedule"] == "ddp" for row in result["rows"]):
            console.print(
                "ddp is Lightning's own DDP: not instrumented, so it has no bound of its own; its schedule "
                "is wfbp's (the same bound and simulation)."
            )
        floor = next((row.get("weights_vs_ddp") for row in result["rows"] if row["schedule"] == "ddp"), None)
        if floor and floor == floor:  # neither 0 nor NaN
            console.print(
                f"ddp differs from its own second run by {floor:.1e}: on this device the same training is not "
                "bit-reproducible (on a GPU, kernels need not sum in a fixed order unless deterministic "
                "algorithms are asked for), so the weights column is judged against that, not against 0."
            )
        warn_if_noisy(result, console, more_steps)


def _full_table(result: dict) -> Table:
    table = Table()
    for column in (
        "schedule",
        "step (ms)",
        "CPU (ms)",
        "samples/s",
        "vs ddp",
        "median vs ddp",
        "MB sent/step",
        "of which node-local",
        "best possible (ms)",
        "measured / best",
        "simulated (ms)",
        "sim error",
        "weights vs ddp",
    ):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(
            row["schedule"],
            f"{row['step_ms']:.1f}",
            f"{row['cpu_ms']:.1f}",
            f"{row['samples_per_s']:.1f}",
            _fmt(row["speedup_vs_ddp"], ".3f"),
            _fmt(row.get("median_speedup_vs_ddp"), ".3f"),
            _fmt(row.get("wire_mb"), ".2f"),
            _fmt(row.get("local_mb"), ".2f"),
            _fmt(row["theoretical_ms"], ".1f"),
            _fmt(row["measured_over_theoretical"], ".2f"),
            _fmt(row["predicted_ms"], ".1f"),
            _fmt(row["prediction_error"], "+.1%"),
            _fmt(row.get("weights_vs_ddp"), ".1e"),
        )
    return table


def _compact_table(result: dict) -> Table:
    table = Table()
    for column in ("schedule", *COMPACT):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(
            row["schedule"],
            f"{row['step_ms']:.1f}",
            _fmt(row["speedup_vs_ddp"], ".2f"),
            _fmt(row.get("wire_mb"), ".2f"),
            _fmt(row["theoretical_ms"], ".1f"),
            _fmt(row.get("weights_vs_ddp"), ".1e"),
        )
    return table


def _workers(spec: dict) -> int:
    cluster = spec.get("cluster") or {}
    return cluster["nodes"] * cluster["workers_per_node"] if cluster.get("nodes") else spec["devices"]


def warn_if_noisy(result: dict, console: Console, more_steps: str = "raise steps= or rounds=") -> None:
    for row in result["rows"]:
        times = row.get("rounds_ms", [])
        if len(times) > 1 and max(times) / min(times) - 1 > ROUNDS_AGREE:
            console.print(
                f"[yellow]commsched: the {len(times)} rounds of {row['schedule']} on {result['model']} "
                f"disagree by {max(times) / min(times) - 1:.0%} ({', '.join(f'{t:.0f}' for t in times)} ms): "
                f"too few steps to trust; {more_steps}[/yellow]"
            )


def write_bench_csv(results: list[dict], rate: str, path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["model", "link_rate", *COLUMNS])
        writer.writeheader()
        for result in results:
            for row in result["rows"]:
                writer.writerow({"model": result["model"], "link_rate": rate, **{k: row.get(k) for k in COLUMNS}})


def plot_bench(results: list[dict], rate: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4.4), squeeze=False)
    for ax, result in zip(axes[0], results):
        names = [row["schedule"] for row in result["rows"]]
        x = range(len(names))
        for offset, key, label in (
            (-0.27, "step_ms", "measured"),
            (0.0, "predicted_ms", "simulated"),
            (0.27, "theoretical_ms", "best possible"),
        ):
            ax.bar([i + offset for i in x], [row[key] or 0.0 for row in result["rows"]], width=0.27, label=label)
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{result['model']}, link {rate}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=3, frameon=False)  # below the bars, never on them
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
