"""MSTopK's selection time against torch.topk (magnitudes), k = density x d, median of REPEATS.

    .venv/bin/python recipes/mstopk_time.py [--device cuda] [--density 0.001] [--sizes 1e6,1e7,1e8]

On CUDA both are timed with events after a warm-up (completion, not enqueue).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from commsched.compression import mstopk


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
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--sizes", default="1e6,1e7,1e8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    print("| elements | k | torch.topk (ms) | MSTopK, 30 samplings (ms) | recall of topk's indices |")
    print("|---|---|---|---|---|")
    for size in (int(float(s)) for s in args.sizes.split(",")):
        x = torch.randn(size, device=device)
        k = max(1, int(args.density * size))
        exact = timed(lambda: torch.topk(x.abs(), k, sorted=False), device, args.repeats)
        approximate = timed(lambda: mstopk(x, k), device, args.repeats)
        chosen = mstopk(x, k)[1]
        truth = torch.topk(x.abs(), k, sorted=False).indices
        recall = torch.isin(chosen, truth).float().mean().item()
        print(f"| {size:,} | {k:,} | {exact * 1e3:.1f} | {approximate * 1e3:.1f} | {recall:.4f} |", flush=True)


if __name__ == "__main__":
    main()
