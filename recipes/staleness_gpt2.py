"""One step of staleness under AdamW on a language model: GPT-2 tiny (2 layers, 64 wide, bytes) on
Python's documentation topics, 300 steps of batch 16, weight decay 0.01, trained by the single-process
reference (`tests/workers/stale_reference.py`, `train_text`) synchronously, one step stale, and one
step stale with linear weight prediction (what DeFT's `compensation="auto"` runs under AdamW). Staleness
starts after `--stale-from` synchronous steps. Mean held-out loss over SEEDS seeds, and the stale
runs' loss relative to it.

    .venv/bin/python recipes/staleness_gpt2.py [--seeds 3] [--lrs 0.003 0.001 0.006] [--steps 300]
        [--compensations none predict spike+predict]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
from stale_reference import train_text  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-3, 6e-3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stale-from", type=int, default=10, help="synchronous steps before the staleness starts")
    parser.add_argument(
        "--compensations",
        nargs="+",
        default=["none", "predict"],
        choices=("none", "predict", "spike", "spike+predict"),
        help="spike: the reference's Adam analogue of spike compensation (not in the product)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = " | ".join(f"stale, {c}" if c != "none" else "stale" for c in args.compensations)
    print(f"| lr | sync held-out loss | {names} |")
    print("|---|---|" + "---|" * len(args.compensations))
    for lr in args.lrs:

        def loss(staleness: int, compensation: str = "none") -> float:
            return statistics.mean(
                train_text(
                    lr, staleness, args.steps, seed, compensation=compensation, stale_from=args.stale_from
                ).accuracy
                for seed in range(args.seeds)
            )

        sync = loss(0)
        cells = " | ".join(f"{100 * (loss(1, c) / sync - 1):+.2f}%" for c in args.compensations)
        print(f"| {lr:g} | {sync:.4f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
