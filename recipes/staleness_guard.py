"""Would a guard on the loss make a one-step-stale plan safe? The single-process stale-SGD reference
(`tests/workers/stale_reference.py`: SGD with momentum 0.9, weight decay 5e-4, batch 64, digits,
BatchNorm) trained synchronously, and with spike+predict-compensated staleness from step `--stale-from`
under a guard. After `--window` stale iterations the guard compares their mean training loss with
that of the `--window` synchronous iterations before. If it did not fall, the rest of training is
synchronous: with `--rollback`, from the weights, BatchNorm buffers and velocity of the switch
(what the stale iterations did is thrown away); without, from where the stale iterations left it.
Prints each seed's accuracies and the guard's verdict, then the mean difference in points.

The guard is not in the product; this measures whether it would be worth building.

    .venv/bin/python recipes/staleness_guard.py vgg16_bn 0.05 [--stale-from 22] [--rollback] [--seeds 5] [--epochs 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import deque
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
import stale_reference as reference  # noqa: E402

SHAPES = {"bn_net": (16, 8), "resnet18": (8, 8), "vgg16_bn": (8, 32)}
"""Each model's width and input resolution, as in recipes/staleness_compensation.py."""


def train(args: argparse.Namespace, seed: int, guarded: bool) -> tuple[float, str]:
    """Held-out accuracy, and what the guard decided (synchronous throughout when not `guarded`)."""
    width, resolution = SHAPES[args.model]
    torch.manual_seed(seed)
    (x, y), (x_val, y_val) = reference.digits(resolution)
    model = reference.MODELS[args.model](width)
    params = list(model.parameters())
    optimizer = reference.StaleSGD(params, args.lr, 0.9, 5e-4, 1, "spike+predict" if guarded else "none")
    late: deque = deque()
    run = reference.Run(0.0)
    shuffle = torch.Generator().manual_seed(seed)
    stale, verdict, snapshot, iteration = guarded, "synchronous", None, 0
    start, window = args.stale_from, args.window
    for _ in range(args.epochs):
        order = torch.randperm(len(y), generator=shuffle)
        for first in range(0, len(y) - 64 + 1, 64):
            batch = order[first:first + 64]
            model.train()
            iteration += 1
            if stale and iteration == start + 1 and args.rollback:
                snapshot = ({k: v.clone() for k, v in model.state_dict().items()},
                            [None if v is None else v.clone() for v in optimizer.velocity], [u.clone() for u in optimizer.last_update])
            if stale and iteration == start + window + 1:
                before, after = statistics.mean(run.losses[start - window:start]), statistics.mean(run.losses[start:start + window])
                verdict = f"{'kept' if after < before else 'stopped'} ({before:.2f} -> {after:.2f})"
                if after >= before:
                    stale = False
                    if snapshot is not None:
                        late.clear()
                        model.load_state_dict(snapshot[0])
                        optimizer.velocity, optimizer.last_update = snapshot[1], snapshot[2]
                    while late:  # what is in flight is applied, then every step is synchronous
                        optimizer.staleness = 1
                        optimizer.step(*late.popleft())
            optimizer.staleness = 1 if stale and iteration > start else 0
            reference.stale_iteration(params, optimizer, late, run, lambda: F.cross_entropy(model(x[batch]), y[batch]))
    model.eval()
    with torch.no_grad():
        return float((model(x_val).argmax(1) == y_val).float().mean()), verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=list(SHAPES))
    parser.add_argument("lr", type=float)
    parser.add_argument("--stale-from", type=int, default=22)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--rollback", action="store_true")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    synchronous, guarded = [], []
    for seed in range(args.seeds):
        sync_accuracy, _ = train(args, seed, guarded=False)
        guarded_accuracy, verdict = train(args, seed, guarded=True)
        synchronous.append(sync_accuracy)
        guarded.append(guarded_accuracy)
        print(f"seed {seed}: synchronous {sync_accuracy:.3f}, guarded {guarded_accuracy:.3f}, {verdict}", flush=True)
    difference = 100 * (statistics.mean(guarded) - statistics.mean(synchronous))
    print(f"{args.model} lr {args.lr:g}: synchronous {statistics.mean(synchronous):.3f}, guarded {difference:+.1f} points")


if __name__ == "__main__":
    main()
