"""Markdown tables of `recipes/planners.sh` runs.

    .venv/bin/python recipes/planners_table.py multirun/planners/1gbit/vgg16 [more run directories...]

Per directory: samples/s of every grid point and planner, each against the best fixed size under
the same schedule, and the model plans' predicted step with its error. With several directories, a
summary follows: one row per model and link, every planner against the best point of the grid.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PLANNERS = ("mgwfbp", "mgwfbp-greedy", "dear-model", "bayes")


def load_runs(root: Path) -> list[dict]:
    rows = []
    for summary_file in sorted(root.glob("*/*/summary.json")):
        summary = json.loads(summary_file.read_text())
        plan_file = summary_file.parent / "commsched_plan.json"
        plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
        fusion = summary["fusion"]
        label = f"{fusion} {summary['bucket_cap_mb']:g} MB" if fusion == "fixed" else fusion
        if fusion == "bayes" and plan:
            label += f" (chose {plan['details']['bucket_mb']:.1f} MB in {len(plan['details']['trials'])} trials)"
        rows.append(
            {
                "schedule": summary["schedule"],
                "fusion": fusion,
                "label": label,
                "bucket_cap_mb": summary["bucket_cap_mb"],
                "plan": plan,
                "samples_per_s": summary["samples_per_s"],
                "step_ms": summary["step_ms"],
                "predicted_ms": plan["predicted_s"] * 1e3 if plan and plan.get("predicted_s") else None,
                "buckets": len(plan["buckets"]) if plan else None,
            }
        )
    return rows


def best_fixed(rows: list[dict], schedule: str | None = None) -> dict | None:
    grid = [r for r in rows if r["fusion"] == "fixed" and schedule in (None, r["schedule"])]
    return max(grid, key=lambda r: r["samples_per_s"], default=None)


def prediction_error(row: dict) -> str:
    return f"{row['predicted_ms'] / row['step_ms'] - 1:+.1%}" if row["predicted_ms"] else "-"


def detail_table(rows: list[dict]) -> list[str]:
    lines = [
        "| schedule | fusion | buckets | samples/s | step (ms) | vs best fixed size | predicted (ms) "
        "| prediction error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["schedule"], r["fusion"] != "fixed", -r["samples_per_s"])):
        best = best_fixed(rows, row["schedule"])
        versus = f"{row['samples_per_s'] / best['samples_per_s']:.3f}" if best else "-"
        predicted = f"{row['predicted_ms']:.1f}" if row["predicted_ms"] else "-"
        lines.append(
            f"| {row['schedule']} | {row['label']} | {row['buckets'] or '-'} | {row['samples_per_s']:.1f} | "
            f"{row['step_ms']:.1f} | {versus} | {predicted} | {prediction_error(row)} |"
        )
    return lines


def summary_row(root: Path, rows: list[dict]) -> str:
    """model, link, the best grid point per schedule, dear at 25 MB, then each planner as samples/s with its
    ratio to the best grid point of its own schedule (mgwfbp plans run under wfbp, the others under dear)."""
    cells = [root.name, root.parent.name]
    for schedule in ("wfbp", "dear"):
        best = best_fixed(rows, schedule)
        cells.append(f"{best['samples_per_s']:.1f} ({best['bucket_cap_mb']:g} MB)" if best else "-")
    default = next(
        (r for r in rows if r["fusion"] == "fixed" and r["schedule"] == "dear" and r["bucket_cap_mb"] == 25), None
    )
    for row in [default] + [next((r for r in rows if r["fusion"] == p), None) for p in PLANNERS]:
        best = best_fixed(rows, row["schedule"]) if row else None
        if row is None or best is None:
            cells.append("-")
            continue
        cell = f"{row['samples_per_s']:.1f} ({row['samples_per_s'] / best['samples_per_s']:.2f})"
        if row["predicted_ms"]:
            cell += f", pred. {prediction_error(row)}"
        if row["fusion"] == "bayes" and row["plan"]:
            cell += f", {row['plan']['details']['bucket_mb']:.1f} MB"
        cells.append(cell)
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    roots = [Path(arg) for arg in sys.argv[1:]]
    if not roots:
        sys.exit(__doc__)
    loaded = [(root, load_runs(root)) for root in roots]
    for root, rows in loaded:
        print(f"\n### {root}\n")
        print("\n".join(detail_table(rows)))
    if len(loaded) > 1:
        print("\n### Summary: samples/s (ratio to the best fixed size under the same schedule)\n")
        print("| model | link | best wfbp fixed | best dear fixed | dear 25 MB | " + " | ".join(PLANNERS) + " |")
        print("|---|---|---|---|---|" + "---|" * len(PLANNERS))
        for root, rows in loaded:
            print(summary_row(root, rows))


if __name__ == "__main__":
    main()
