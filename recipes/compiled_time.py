"""Step times of a CNN, eager and under torch.compile (as Lightning's docs show it:
`trainer.fit(torch.compile(model))`), for Lightning's ddp and each exact schedule at its defaults,
on 2 CPU processes over the unlimited loopback; with the graph breaks and recompiles dynamo
counted after the warm-up. Timed steps start once the strategy has settled (its own choices made).

    .venv/bin/python recipes/compiled_time.py [STEPS] [ROUNDS] [MODEL]

MODEL: "tiny" (a 0.3 M-parameter CNN, the default) or "bench" (the benchmark's small CNN, 3.06 M
parameters, whose communication is about its compute on this loopback).

Rank 0 prints one Markdown row per schedule: eager ms, compiled ms, compiled against eager, the
compiled step against compiled ddp's (below 1: faster), graph breaks, graphs compiled after the
warm-up, and what `dear` ran in each round after measuring DeAR against WFBP.
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

import commsched  # noqa: F401  (registers the strategies)
from commsched.models import SmallCNNBackbone
from commsched.timing import StepTimer

warnings.filterwarnings("ignore")
SCHEDULES = ("ddp", "wfbp", "dear")
BATCH = 32


class CNN(pl.LightningModule):
    """0.3 M parameters ("tiny") or 3.06 M ("bench"). No `self.log` in `training_step`: with torch 2.13 and
    Lightning 2.6 dynamo fails on it under every strategy, ddp included (it inspects the hook's signature)."""

    def __init__(self, size: str = "tiny") -> None:
        super().__init__()
        if size == "bench":
            self.net: nn.Module = SmallCNNBackbone(width=64)
        else:
            self.net = nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=1),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(4),
                nn.Flatten(),
                nn.Linear(1024, 256),
                nn.ReLU(),
                nn.Linear(256, 10),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 3, 32, 32, generator=g), torch.randint(0, 10, (samples,), generator=g))


def ran(strategy: object) -> str:
    """What `dear` ran after choosing between DeAR and WFBP ("" for the others)."""
    fallback = getattr(getattr(getattr(strategy, "last_schedule", None), "settings", None), "fallback", None)
    if fallback is None or fallback.verdict is None:
        return ""
    return "DeAR" if fallback.verdict.keep else "WFBP"


def timed(schedule: str, compiled: bool, steps: int, size: str) -> tuple[float, int, int, str]:
    torch._dynamo.reset()
    counters.clear()
    pl.seed_everything(0, verbose=False)
    model = CNN(size)
    timer = StepTimer(warmup=3, stop_after=steps)
    trainer = pl.Trainer(
        strategy=schedule,
        accelerator="cpu",
        devices=2,
        max_steps=steps + 200,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        default_root_dir=f"outputs/compiled_time/{schedule}",
    )
    trainer.fit(
        torch.compile(model) if compiled else model, DataLoader(data(BATCH * 2 * (steps + 202)), batch_size=BATCH)
    )
    return (
        timer.median,
        sum(counters["graph_break"].values()),
        counters["stats"]["unique_graphs"],
        ran(trainer.strategy),
    )


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    size = sys.argv[3] if len(sys.argv) > 3 else "tiny"
    best: dict[tuple[str, bool], float] = {}
    dynamo: dict[str, tuple[int, int]] = {}
    chose: dict[tuple[str, bool], list[str]] = {}
    for _ in range(rounds):
        for schedule in SCHEDULES:
            for compiled in (False, True):
                seconds, breaks, graphs, arm = timed(schedule, compiled, steps, size)
                chose.setdefault((schedule, compiled), []).append(arm)
                best[(schedule, compiled)] = min(seconds, best.get((schedule, compiled), float("inf")))
                if compiled:
                    dynamo[schedule] = (breaks, graphs)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(
        "| schedule | eager (ms) | compiled (ms) | compiled / eager | step / compiled ddp's | graph breaks | graphs "
        "| ran (eager; compiled) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for schedule in SCHEDULES:
        eager, compiled = best[(schedule, False)] * 1e3, best[(schedule, True)] * 1e3
        arms = "; ".join(",".join(chose[(schedule, c)]) for c in (False, True)) if any(chose[(schedule, False)]) else ""
        print(
            f"| {schedule} | {eager:.1f} | {compiled:.1f} | {compiled / eager:.2f} | "
            f"{compiled / (best[('ddp', True)] * 1e3):.2f} | {dynamo[schedule][0]} | {dynamo[schedule][1]} | {arms} |"
        )


if __name__ == "__main__":
    main()
