"""Selection time of each top-k method against torch.topk (magnitudes), k = density x d, median of
REPEATS, with each method's recall of torch.topk's indices.

    .venv/bin/python recipes/selection_time.py [--device cuda] [--densities 0.01,0.001] [--sizes 1e6,1e7,1e8]
        [--threads 1]

On CUDA every method is timed with events after a warm-up (completion, not enqueue).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from commsched.compression import mstopk, sampled_topk


def timed(run, device: torch.device, repeats: int) -> float:
    run()  # warm-up
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--densities", default="0.01,0.001")
    parser.add_argument("--sizes", default="1e6,1e7,1e8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    methods = {"sampled threshold": sampled_topk, "MSTopK, 30 samplings": mstopk}
    print(f"device {device}, {torch.get_num_threads()} CPU threads, fp32 normal values")
    print(
        "| elements | density | torch.topk (ms) | " + " | ".join(f"{m} (ms, speed-up, recall)" for m in methods) + " |"
    )
    print("|---|---|---|" + "---|" * len(methods))
    for size in (int(float(s)) for s in args.sizes.split(",")):
        x = torch.randn(size, device=device)
        for density in (float(d) for d in args.densities.split(",")):
            k = max(1, int(density * size))
            exact = timed(lambda: torch.topk(x.abs(), k, sorted=False), device, args.repeats)
            truth = torch.topk(x.abs(), k, sorted=False).indices
            cells = []
            for select in methods.values():
                seconds = timed(lambda: select(x, k), device, args.repeats)
                recall = torch.isin(select(x, k)[1], truth).float().mean().item()
                cells.append(f"{seconds * 1e3:.1f}, {exact / seconds:.2f}x, {recall:.4f}")
            print(f"| {size:,} | {density:g} | {exact * 1e3:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
