"""`commsched-simulate`: predicted iteration time and speedup of each schedule from 2 to 2048 workers.

    commsched-simulate --workload resnet50 --bandwidth 10gbit --alpha 50e-6
    commsched-simulate --workload vgg16 --algorithm tree --out sim/      # + speedup.png, CSV, traces
    commsched-simulate --workload run/profile.json --link run/profile.json --workers 2
    commsched-simulate --plugins my_schedules --schedules wfbp,mine      # a schedule registered by a module

A profile JSON from the profiler (`profile_steps=N`) gives measured per-layer times; `--link` with a
profile or probe JSON uses the fitted collective costs instead of alpha-beta (valid only at the
world size they were measured on).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from commsched.errors import CommSchedConfigError, bad_value
from commsched.lab import require_lab
from commsched.options import density_value, positive_int
from commsched.plugins import import_plugins
from commsched.rates import parse_rate
from commsched.sim.cost_models import AlphaBeta, CostModel, Fitted
from commsched.sim.simulate import SIM_SCHEDULES, simulate, simulated_schedule_names
from commsched.sim.workload import BUILTIN_WORKLOADS, Workload, builtin
from commsched.trace import write_chrome_trace

DEFAULT_WORKERS = "2,4,8,16,32,64,128,256,512,1024,2048"
WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one gradient element on the wire, by `comm_dtype`."""


def load_workload(args: argparse.Namespace) -> Workload:
    if args.workload in BUILTIN_WORKLOADS:  # fp32 gradients; a profile's bytes are those its run sent
        return builtin(args.workload, args.batch_size, args.device_tflops).sent_as(WIRE_BYTES[args.comm_dtype])
    path = Path(args.workload)
    if not path.is_file():
        raise bad_value("--workload", args.workload, f"one of {', '.join(BUILTIN_WORKLOADS)} or a profile JSON file")
    return Workload.load(path)


def load_network(args: argparse.Namespace) -> CostModel:
    if args.link is not None:
        data = json.loads(Path(args.link).read_text())
        return Fitted.from_dict(data.get("link", data))
    return AlphaBeta.from_rate(parse_rate(args.bandwidth), args.alpha, args.algorithm)


def parse_list(text: str, field: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    for item in items:
        if allowed is not None and item not in allowed:
            raise bad_value(field, item, allowed)
    if not items:
        raise bad_value(field, text, "a comma-separated, non-empty list")
    return items


def parse_workers(text: str) -> list[int]:
    try:
        workers = [int(item) for item in parse_list(text, "--workers")]
    except ValueError:
        raise bad_value("--workers", text, "comma-separated integers >= 1, e.g. 2,4,8") from None
    if any(p < 1 for p in workers):
        raise bad_value("--workers", text, "comma-separated integers >= 1, e.g. 2,4,8")
    return workers


def plot_speedup(rows: list[dict], schedules: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    workers = sorted({row["workers"] for row in rows})
    axes.plot(workers, workers, "k--", linewidth=0.8, label="linear")
    for schedule in schedules:
        series = [(row["workers"], row["speedup"]) for row in rows if row["schedule"] == schedule]
        axes.plot(*zip(*series), marker="o", markersize=3, label=schedule)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    axes.set_xlabel("workers")
    axes.set_ylabel("speedup over one worker")
    axes.set_title(title)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="resnet50", help=f"{', '.join(BUILTIN_WORKLOADS)} or a profile JSON")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker, built-in workloads only")
    parser.add_argument("--device-tflops", type=float, default=10.0, help="effective FLOP/s of one worker (built-in)")
    parser.add_argument("--workers", default=DEFAULT_WORKERS)
    parser.add_argument("--schedules", default=",".join(SIM_SCHEDULES))
    parser.add_argument("--algorithm", default="ring", choices=("ring", "tree"))
    parser.add_argument(
        "--comm-dtype", default="fp32", choices=tuple(WIRE_BYTES), help="what gradients travel as (built-in workloads)"
    )
    parser.add_argument("--bandwidth", default="10gbit", help="link rate, e.g. 10gbit, 200mbit")
    parser.add_argument("--alpha", type=float, default=50e-6, help="link latency in seconds")
    parser.add_argument("--link", default=None, help="a profile/probe JSON: use its fitted costs instead")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="dear_fused and deft bucket size")
    parser.add_argument(
        "--mu",
        type=float,
        default=1.65,
        help="deft: the secondary link's all-reduce time over the primary's (a run measures it)",
    )
    parser.add_argument("--partition-mb", type=float, default=4.0, help="bytescheduler partition size")
    parser.add_argument(
        "--density", type=float, default=0.01, help="topk, hitopk: the share of each bucket a rank sends"
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="hitopk, hier_dense: workers per node")
    parser.add_argument("--intra-bandwidth", default="100gbit", help="hitopk, hier_dense: the node-local link's rate")
    parser.add_argument(
        "--intra-alpha", type=float, default=5e-6, help="hitopk, hier_dense: the node-local link's latency"
    )
    parser.add_argument("--out", type=Path, default=None, help="directory for simulate.csv, speedup.png, traces")
    parser.add_argument(
        "--plugins", default="", help="modules to import first: the schedules they register can be simulated"
    )
    args = parser.parse_args(argv)
    require_lab("commsched-simulate")
    console = Console(width=160)
    try:
        workload = load_workload(args)
        network = load_network(args)
        workers = parse_workers(args.workers)
        import_plugins([m.strip() for m in args.plugins.split(",") if m.strip()])
        names = parse_list(args.schedules, "--schedules", simulated_schedule_names())
        density = density_value("--density", args.density)
        per_node = positive_int("--gpus-per-node", args.gpus_per_node)
        intra = AlphaBeta.from_rate(parse_rate(args.intra_bandwidth), args.intra_alpha)
    except CommSchedConfigError as error:
        parser.error(str(error))

    rows = []
    for p in workers:
        for name in names:
            result = simulate(
                name,
                workload,
                network,
                p,
                args.bucket_mb * 2**20,
                args.partition_mb * 2**20,
                args.mu,
                density,
                per_node,
                intra,
            )
            rows.append(
                {
                    "workers": p,
                    "schedule": name,
                    "iteration_ms": result.iteration_s * 1e3,
                    "speedup": result.speedup(workload, p),
                    "messages": result.buckets,
                    "result": result,
                }
            )

    console.print(
        f"{workload.name}: {len(workload.layers)} layers, {workload.nbytes / 2**20:.1f} MB of gradients, "
        f"t_ff {workload.forward_s * 1e3:.1f} ms, t_bp {workload.backward_s * 1e3:.1f} ms; network: {network}"
    )
    table = Table(title="iteration ms (speedup over one worker)")
    table.add_column("workers", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for p in workers:
        cells = [f"{r['iteration_ms']:.1f} ({r['speedup']:.1f})" for r in rows if r["workers"] == p]
        table.add_row(str(p), *cells)
    console.print(table)
    for row in rows:
        if row["schedule"] == "deft":  # its iterations are not all updates: say how many are
            plan = row["result"].plan
            console.print(
                f"deft at {row['workers']} workers: {plan.describe()}: "
                f"{len(plan.k)} update(s) per {plan.n} iteration(s)"
            )

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "simulate.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["workers", "schedule", "iteration_ms", "speedup", "messages"])
            writer.writeheader()
            writer.writerows({k: v for k, v in row.items() if k != "result"} for row in rows)
        plot_speedup(rows, names, f"{workload.name}, {network}", args.out / "speedup.png")
        for row in rows:
            if row["workers"] == workers[0]:
                write_chrome_trace(row["result"].spans, args.out / f"trace_{row['schedule']}_P{workers[0]}.json")
        console.print(f"wrote {args.out}/simulate.csv, speedup.png and Chrome traces for {workers[0]} workers")


if __name__ == "__main__":
    main()
