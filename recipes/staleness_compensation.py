"""Which compensation of one step of staleness keeps synchronous accuracy? The single-process stale-SGD
reference of the tests (`tests/workers/stale_reference.py`: SGD written out, BatchNorm, weight decay
5e-4, batch 64, digits, 3 epochs) trained synchronously, one step stale, and one step stale with each
compensation it implements, at the same learning rate and momentum; mean held-out accuracy over SEEDS
seeds, points against synchronous. Staleness starts after `--stale-from` synchronous steps (10: where
DeFT's default warm-up and measured steps end; 0: from the first step).

    .venv/bin/python recipes/staleness_compensation.py [--models bn_net resnet18 vgg16_bn] [--seeds 5] [--stale-from 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
from stale_reference import COMPENSATIONS, train  # noqa: E402

SETTINGS = ((0.05, 0.9), (0.02, 0.9), (0.01, 0.9), (0.1, 0.5), (0.3, 0.0), (0.1, 0.0))
SHAPES = {"bn_net": (16, 8), "resnet18": (8, 8), "vgg16_bn": (8, 32)}
"""Each model's width and input resolution."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--compensations", nargs="+", default=list(COMPENSATIONS), choices=COMPENSATIONS)
    parser.add_argument("--settings", nargs="+", default=[f"{lr:g}/{m:g}" for lr, m in SETTINGS], help="lr/momentum")
    parser.add_argument(
        "--optimizer",
        default="sgd",
        choices=("sgd", "adamw"),
        help="adamw: torch's AdamW (weight decay 0.01; momentum ignored), compensations none and predict",
    )
    parser.add_argument("--stale-from", type=int, default=10, help="synchronous steps before the staleness starts")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = " | ".join(f"stale, {c}" if c != "none" else "stale" for c in args.compensations)
    print(f"| model | lr | momentum | sync acc | {names} |")
    print("|---|---|---|---|" + "---|" * len(args.compensations))
    for name in args.models:
        width, resolution = SHAPES[name]
        for setting in args.settings:
            lr, momentum = (float(v) for v in setting.split("/"))

            def accuracy(staleness: int, compensation: str = "none") -> float:
                decay = 0.01 if args.optimizer == "adamw" else 5e-4
                return statistics.mean(
                    train(
                        lr,
                        momentum,
                        staleness,
                        epochs=args.epochs,
                        seed=seed,
                        width=width,
                        model_name=name,
                        resolution=resolution,
                        compensation=compensation,
                        weight_decay=decay,
                        optimizer_name=args.optimizer,
                        stale_from=args.stale_from,
                    ).accuracy
                    for seed in range(args.seeds)
                )

            sync = accuracy(0)
            cells = " | ".join(f"{100 * (accuracy(1, c) - sync):+.1f}" for c in args.compensations)
            print(f"| {name} | {lr:g} | {momentum:g} | {sync:.3f} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
