"""A user's compiled LightningModule, as Lightning's docs show it (`trainer.fit(torch.compile(model))`),
under ddp and each exact schedule, one after another in the same two processes.

Usage: python run_compiled.py OUT_DIR STRATEGY [STRATEGY ...]

Rank 0 writes OUT_DIR/<strategy>.pt: the final weights, the graph breaks dynamo recorded, and the
graphs it had compiled after the warm-up steps and at the end (more at the end: recompiles).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

import commsched  # noqa: F401  (registers the strategies)

warnings.filterwarnings("ignore", ".*does not have many workers.*")
STEPS, WARMUP = 10, 3


class SmallCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class GraphsAfterWarmup(pl.Callback):
    def __init__(self) -> None:
        self.after_warmup = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == WARMUP:
            self.after_warmup = counters["stats"]["unique_graphs"]


def main() -> None:
    out, strategies = Path(sys.argv[1]), sys.argv[2:]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(2 * STEPS * 8, 3, 8, 8, generator=generator),
        torch.randint(0, 10, (2 * STEPS * 8,), generator=generator),
    )
    for name in strategies:
        torch._dynamo.reset()
        counters.clear()
        pl.seed_everything(3, verbose=False)
        model = SmallCNN()
        watch = GraphsAfterWarmup()
        trainer = pl.Trainer(
            strategy=name,
            accelerator="cpu",
            devices=2,
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[watch],
            default_root_dir=out / f"{name}-run",
        )
        trainer.fit(torch.compile(model), DataLoader(data, batch_size=8))
        if trainer.is_global_zero:
            torch.save(
                {
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "graph_breaks": sum(counters["graph_break"].values()),
                    "break_reasons": dict(counters["graph_break"]),
                    "graphs_after_warmup": watch.after_warmup,
                    "graphs_at_end": counters["stats"]["unique_graphs"],
                },
                out / f"{name}.pt",
            )


if __name__ == "__main__":
    main()
