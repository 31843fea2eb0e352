"""The stream search's trials as data (JSON), a table (Markdown) and a plot (step time per trial, by
technique). Trials are numbered from 1, as the lines said during the run number them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from commsched.lab import has_lab, plot_skipped
from commsched.reducers.units import Striping
from commsched.run_files import write_json, write_text, write_whole
from commsched.say import say


def save_trials(out_dir: Path, trials: list[dict[str, Any]], chosen: Optional[Striping], name: str) -> list[Path]:
    """The files written (for the run's closing summary); `chosen` None: the search did not finish."""
    path = out_dir / name
    written = [
        write_json(path, {"chosen": chosen.to_json() if chosen else None, "trials": trials}),
        write_text(path.with_suffix(".md"), table(trials) + "\n"),
    ]
    if not has_lab():
        say(plot_skipped(f"{path.with_suffix('.png')} (the trials are in {path.with_suffix('.md')})"))
        return written
    return [*written, write_whole(path.with_suffix(".png"), lambda partial: plot_trials(trials, partial))]


def table(trials: list[dict[str, Any]]) -> str:
    """Markdown: one row per trial."""
    rows = [
        "| trial | technique | streams | unit (MB) | two-level | ms/step | new best |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, t in enumerate(trials, 1):
        unit = "-" if t["streams"] == 1 else f"{t['unit_mb']:g}"
        rows.append(
            f"| {i} | {t['technique']} | {t['streams']} | {unit} | {'yes' if t['hierarchical'] else 'no'} | "
            f"{t['step_s'] * 1e3:.1f} | {'*' if t['new_best'] else ''} |"
        )
    return "\n".join(rows)


def plot_trials(trials: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for technique in dict.fromkeys(t["technique"] for t in trials):
        points = [(i, t["step_s"] * 1e3) for i, t in enumerate(trials, 1) if t["technique"] == technique]
        ax.scatter(*zip(*points), label=technique, s=18)
    best, so_far = [], float("inf")
    for t in trials:
        so_far = min(so_far, t["step_s"] * 1e3)
        best.append(so_far)
    ax.step(range(1, len(best) + 1), best, where="post", color="black", linewidth=1, label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
