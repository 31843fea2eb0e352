"""Side-by-side step time of Lightning `ddp`, `wfbp` and `dear`, with each schedule's theoretical best.

Runs every schedule in the same worker processes, one after another, then measures the parts the
DeAR paper's model (dear.txt Eq. 7-8) is made of, on the same processes and link:
t_ff / t_bp (forward / backward without communication, both ranks computing at once) and
t_ar / t_rs / t_ag (all-reduce / reduce-scatter / all-gather of the bucket buffers, in isolation):

    t_wfbp* = t_ff + max(t_bp, t_ar)        t_dear* = max(t_ff, t_ag) + max(t_bp, t_rs)

Unlimited local link:   python recipes/bench_schedules.py
Emulated 1 Gbit link:   sudo recipes/netns_run.sh 1gbit .venv/bin/python recipes/bench_schedules.py
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

import commsched
import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from commsched.buckets import build_plan
from commsched.data import SyntheticImages
from commsched.fusion import plan_fixed
from commsched.links import Link
from commsched.models import SmallCNN
from commsched.timing import StepTimer

SCHEDULES = ("ddp", "wfbp", "dear")


def median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train(schedule: str, args: argparse.Namespace) -> tuple[float, int]:
    pl.seed_everything(0, verbose=False)
    if schedule == "ddp":
        strategy = DDPStrategy(bucket_cap_mb=args.bucket_cap_mb)
    else:
        strategy = commsched.STRATEGIES[schedule][0](bucket_cap_mb=args.bucket_cap_mb)
    timer = StepTimer(warmup=args.warmup)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.warmup + args.steps + 1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer],
    )
    data = DataLoader(SyntheticImages(args.batch_size * args.devices * (args.warmup + args.steps + 2)), batch_size=args.batch_size)
    trainer.fit(SmallCNN(width=args.width), data)
    return timer.median, trainer.global_rank


def components(args: argparse.Namespace) -> dict[str, float]:
    """t_ff, t_bp on this rank's model; collective times for the bucket plan the strategies use."""
    model = SmallCNN(width=args.width)
    images = torch.randn(args.batch_size, 3, 32, 32)
    labels = torch.randint(10, (args.batch_size,))
    ff, bp = [], []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = F.cross_entropy(model(images), labels)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        ff.append(middle - start)
        bp.append(end - middle)
    link = Link()
    world = link.world_size
    plan = build_plan(model, world, lambda infos: plan_fixed(infos, int(args.bucket_cap_mb * 2**20)))
    shards = [torch.zeros(b.shard_numel) for b in plan.buckets]
    scratch = [torch.empty_like(b.buffer) for b in plan.buckets]

    def each_bucket(op: Callable[[int], object]) -> Callable[[], None]:
        return lambda: [work.wait() for work in [op(i) for i in range(len(plan.buckets))]]

    buffers = [b.buffer for b in plan.buckets]
    comm = {
        "t_ar": each_bucket(lambda i: link.all_reduce(buffers[i], "bench")),
        "t_rs": each_bucket(lambda i: link.reduce_scatter(shards[i], buffers[i], "bench", scratch[i])),
        "t_ag": each_bucket(lambda i: link.all_gather(buffers[i], shards[i], "bench")),
    }
    times = {"t_ff": statistics.median(ff[args.warmup :]), "t_bp": statistics.median(bp[args.warmup :])}
    for name, fn in comm.items():
        median_time(fn, 2)  # warm the connections
        times[name] = median_time(fn, args.steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--width", type=int, default=64, help="SmallCNN width (64: 3.1 M parameters)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=2.0, help="the same for ddp, wfbp and dear")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="repeat the ddp/wfbp/dear sequence, keep the best median")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")

    measured: dict[str, float] = {}
    rank = 0
    for _ in range(args.rounds):  # interleaved rounds: a noisy moment hurts every schedule alike
        for schedule in SCHEDULES:
            step, rank = train(schedule, args)
            measured[schedule] = min(measured.get(schedule, float("inf")), step)
    parts = components(args)
    if rank != 0:
        return

    best_wfbp = parts["t_ff"] + max(parts["t_bp"], parts["t_ar"])
    best_dear = max(parts["t_ff"], parts["t_ag"]) + max(parts["t_bp"], parts["t_rs"])
    theory = {"ddp": best_wfbp, "wfbp": best_wfbp, "dear": best_dear}
    params = sum(p.numel() for p in SmallCNN(width=args.width).parameters())
    console = Console()
    console.print(
        f"SmallCNN width {args.width} ({params / 1e6:.2f} M parameters, {params * 4 / 2**20:.1f} MB of gradients), "
        f"{args.devices} workers, batch {args.batch_size}/worker, buckets {args.bucket_cap_mb} MB"
    )
    console.print("  ".join(f"{k} = {v * 1e3:.1f} ms" for k, v in parts.items()))
    table = Table()
    for column in ("schedule", "step (ms)", "samples/s", "vs ddp", "theoretical best (ms)", "measured / best"):
        table.add_column(column, justify="right")
    rows = []
    for schedule in SCHEDULES:
        step = measured[schedule]
        row = {
            "schedule": schedule,
            "step_ms": step * 1e3,
            "samples_per_s": args.batch_size * args.devices / step,
            "speedup_vs_ddp": measured["ddp"] / step,
            "theoretical_ms": theory[schedule] * 1e3,
            "measured_over_theoretical": step / theory[schedule],
            **{k: v * 1e3 for k, v in parts.items()},
        }
        rows.append(row)
        table.add_row(schedule, f"{row['step_ms']:.1f}", f"{row['samples_per_s']:.1f}", f"{row['speedup_vs_ddp']:.3f}",
                      f"{row['theoretical_ms']:.1f}", f"{row['measured_over_theoretical']:.2f}")
    console.print(table)
    if args.csv is not None:
        with args.csv.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
