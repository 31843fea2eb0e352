"""Markdown table of a `recipes/planners.sh` run: samples/s of every grid point and planner, each
planner against the best fixed size under the same schedule, and the model plans' predicted step.

    .venv/bin/python recipes/planners_table.py multirun/planners/1gbit/gpt2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1])
    rows = []
    for summary_file in sorted(root.glob("*/*/summary.json")):
        summary = json.loads(summary_file.read_text())
        plan_file = summary_file.parent / "commsched_plan.json"
        plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
        fusion = summary["fusion"]
        label = f"{fusion} {summary['bucket_cap_mb']:g} MB" if fusion == "fixed" else fusion
        if fusion == "bayes" and plan:
            trials = plan["details"]["trials"]
            label += f" (chose {plan['details']['bucket_mb']:.1f} MB in {len(trials)} trials)"
        rows.append({"schedule": summary["schedule"], "fusion": fusion, "label": label,
                     "samples_per_s": summary["samples_per_s"], "step_ms": summary["step_ms"],
                     "predicted_ms": plan["predicted_s"] * 1e3 if plan and plan.get("predicted_s") else None,
                     "buckets": len(plan["buckets"]) if plan else None})
    best_grid = {}
    for row in rows:
        if row["fusion"] == "fixed":
            best_grid[row["schedule"]] = max(best_grid.get(row["schedule"], 0.0), row["samples_per_s"])
    print("| schedule | fusion | samples/s | step (ms) | vs best fixed size | predicted (ms) | prediction error |")
    print("|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["schedule"], r["fusion"] != "fixed", -r["samples_per_s"])):
        best = best_grid.get(row["schedule"])
        versus = f"{row['samples_per_s'] / best:.3f}" if best else "-"
        predicted = f"{row['predicted_ms']:.1f}" if row["predicted_ms"] else "-"
        error = f"{row['predicted_ms'] / row['step_ms'] - 1:+.1%}" if row["predicted_ms"] else "-"
        print(f"| {row['schedule']} | {row['label']} | {row['samples_per_s']:.1f} | {row['step_ms']:.1f} | {versus} | "
              f"{predicted} | {error} |")


if __name__ == "__main__":
    main()
