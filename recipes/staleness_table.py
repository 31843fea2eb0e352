"""How one iteration of staleness changes held-out accuracy on scikit-learn's digits, next to what
the Preserver's staleness guard measures: the top curvature after 5-9 synchronous steps (DeFT's
probe steps) and where SGD with that staleness stops converging (`commsched.deft.stability`).

Uses the single-process stale-SGD reference of the tests (plain PyTorch, BatchNorm, weight decay
5e-4, batch 64, 3 epochs, 3 seeds). About 2 minutes on 2 cores:

    .venv/bin/python recipes/staleness_table.py [bn_net|resnet18 ...]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
from commsched.deft.curvature import top_curvature  # noqa: E402
from commsched.deft.stability import Stepper, largest_stable_curvature  # noqa: E402
from stale_reference import after_steps, train  # noqa: E402

SETTINGS = ((0.05, 0.9), (0.02, 0.9), (0.01, 0.9), (0.2, 0.5), (0.1, 0.5), (0.05, 0.5), (0.3, 0.0), (0.1, 0.0))
WIDTHS = {"bn_net": 16, "resnet18": 8}


def main() -> None:
    torch.set_num_threads(1)
    print("| model | lr | momentum | top curvature | stale band | curvature / band | sync acc | stale acc | points |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sys.argv[1:] or list(WIDTHS):
        width = WIDTHS[name]
        for lr, momentum in SETTINGS:
            band = largest_stable_curvature(Stepper(lr, momentum, weight_decay=5e-4), 1)
            curvature = statistics.mean(
                top_curvature(loss, list(model.parameters()))
                for model, _, loss in (
                    after_steps(lr, momentum, steps, 0, width=width, model_name=name) for steps in range(5, 10)
                )
            )
            accuracy = {
                s: statistics.mean(
                    train(lr, momentum, s, epochs=3, seed=seed, width=width, model_name=name).accuracy
                    for seed in range(3)
                )
                for s in (0, 1)
            }
            print(
                f"| {name} | {lr:g} | {momentum:g} | {curvature:.1f} | {band:.2f} | {curvature / band:.1f} | "
                f"{accuracy[0]:.3f} | {accuracy[1]:.3f} | {100 * (accuracy[1] - accuracy[0]):+.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
