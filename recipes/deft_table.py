"""Table of recipes/deft_convergence.sh's runs: final val_acc (and train_loss) per variant and seed."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1])
    rows: dict[str, list[dict]] = {}
    for metrics_file in sorted(root.glob("*/seed*/metrics.json")):
        variant = metrics_file.parent.parent.name
        metrics = json.loads(metrics_file.read_text())
        rows.setdefault(variant, []).append({"seed": metrics_file.parent.name, **metrics})
    print(f"{'variant':16} {'seed':6} {'val_acc':>8} {'train_loss':>10} {'samples/s':>10}  plan")
    for variant, runs in rows.items():
        for run in runs:
            plan = run.get("deft", {}).get("plan", "")
            print(
                f"{variant:16} {run['seed']:6} {run.get('val_acc', float('nan')):8.4f} "
                f"{run.get('train_loss', float('nan')):10.4f} "
                f"{run['samples_per_s']:10.1f}  {plan}"
            )
    print()
    reference = statistics.mean(r.get("val_acc", float("nan")) for r in rows.get("ddp", [{}]))
    for variant, runs in rows.items():
        accuracy = statistics.mean(r.get("val_acc", float("nan")) for r in runs)
        speed = statistics.mean(r["samples_per_s"] for r in runs)
        print(
            f"{variant:16} mean val_acc {accuracy:.4f} ({(accuracy - reference) * 100:+.2f} points vs ddp), "
            f"{speed:.1f} samples/s over {len(runs)} seed(s)"
        )


if __name__ == "__main__":
    main()
