"""Table of recipes/compression_cluster.sh's runs: accuracy, MB sent per step and step time per model
and variant. The step time is the median of the steps after the dense warm-up, so a sparse variant is
timed sparse."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml


def warm_up(run_dir: Path) -> int:
    config = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    return int(config.get("compression", {}).get("dense_warmup_steps", 0) or 0)


def main() -> None:
    root = Path(sys.argv[1])
    print(
        f"{'model':10} {'variant':12} {'val_acc':>8} {'val_loss':>9} {'MB/step':>8} {'ms/step':>8}"
        "  (median after the warm-up)"
    )
    for metrics_file in sorted(root.glob("*/*/metrics.json")):
        run_dir = metrics_file.parent
        metrics = {k: (float("nan") if v is None else v) for k, v in json.loads(metrics_file.read_text()).items()}
        steps = metrics.get("step_ms_each") or [metrics["step_ms"]]
        timed = steps[warm_up(run_dir) :] or steps
        print(
            f"{run_dir.parent.name:10} {run_dir.name:12} {metrics.get('val_acc', float('nan')):8.4f} "
            f"{metrics.get('val_loss', float('nan')):9.4f} {metrics.get('wire_mb_per_step', float('nan')):8.2f} "
            f"{statistics.median(timed):8.1f}"
        )


if __name__ == "__main__":
    main()
