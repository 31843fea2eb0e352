"""Would a guard on the loss make a one-step-stale plan safe? The single-process stale-SGD reference
(`tests/workers/stale_reference.py`: SGD with momentum 0.9, weight decay 5e-4, batch 64, digits,
BatchNorm) trained synchronously, and with spike+predict-compensated staleness from step `--stale-from`
under a guard. After `--window` stale iterations the guard compares their mean training loss with
that of the `--window` synchronous iterations before. If it did not fall, the rest of training is
synchronous: with `--rollback`, from the weights, BatchNorm buffers and velocity of the switch
(what the stale iterations did is thrown away); without, from where the stale iterations left it.
Prints each seed's accuracies and the guard's verdict, then the mean difference in points.

With `--windows N` it judges N windows in a row, each against the one before; a stop at any of them
rolls back to the plan's start. DeFT's watch (the Preserver's `watch_steps` and `rollback`) is this
guard with one window, the mean rule and rollback.

    .venv/bin/python recipes/staleness_guard.py vgg16_bn 0.05 [--stale-from 22] [--rollback] [--windows 1]
        [--seeds 5] [--first-seed 0 | --only-seeds 3,9] [--epochs 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
from stale_reference import LossGuard, train  # noqa: E402

SHAPES = {"bn_net": (16, 8), "resnet18": (8, 8), "vgg16_bn": (8, 32)}
"""Each model's width and input resolution, as in recipes/staleness_compensation.py."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=list(SHAPES))
    parser.add_argument("lr", type=float)
    parser.add_argument("--stale-from", type=int, default=22)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--rollback", action="store_true")
    parser.add_argument(
        "--windows",
        type=int,
        default=1,
        help="consecutive windows judged, each against the one before (a stop rolls back to the plan's start)",
    )
    parser.add_argument(
        "--rule",
        choices=["mean", "trend"],
        default="mean",
        help="what the stale window's mean loss must be below: the synchronous window's mean, or its trend carried on",
    )
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="seeds run from here on (to split them over processes)"
    )
    parser.add_argument(
        "--only-seeds",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        help="these seeds (comma-separated) instead of --first-seed and --seeds",
    )
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    width, resolution = SHAPES[args.model]
    common = dict(width=width, resolution=resolution, model_name=args.model, stale_from=args.stale_from)
    synchronous, guarded = [], []
    for seed in args.only_seeds or range(args.first_seed, args.first_seed + args.seeds):
        guard = LossGuard(args.window, args.rollback, args.windows, args.rule)
        sync_accuracy = train(args.lr, 0.9, 0, args.epochs, seed, **common).accuracy
        guarded_accuracy = train(
            args.lr, 0.9, 1, args.epochs, seed, compensation="spike+predict", guard=guard, **common
        ).accuracy
        synchronous.append(sync_accuracy)
        guarded.append(guarded_accuracy)
        print(
            f"seed {seed}: synchronous {sync_accuracy:.3f}, guarded {guarded_accuracy:.3f}, {guard.verdict}", flush=True
        )
    difference = 100 * (statistics.mean(guarded) - statistics.mean(synchronous))
    print(
        f"{args.model} lr {args.lr:g}: synchronous {statistics.mean(synchronous):.3f}, guarded {difference:+.1f} points"
    )


if __name__ == "__main__":
    main()
