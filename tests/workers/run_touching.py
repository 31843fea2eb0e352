"""Code that touches weights, gradients and optimizer state at every point of the loop, under ddp and
dear; each rank saves what it ended with and what its hooks saw.

Usage: python run_touching.py OUT_DIR WORLD_SIZE CASE [CASE ...]   (a case: VARIANT-STRATEGY)

Variants:
- l2first: `training_step` computes an L2 term over every parameter before the forward reaches them;
- shared: a module's forward uses the weight of a layer that runs later (a weight used by two modules);
- readers: callbacks read `.grad` after backward (on rank 0 only) and before the step (clipping on),
  a module hook scales the gradients, a callback reads the momentum buffers and writes the weights
  after every step, another deep-copies the model and saves its state dict;
- rankzero: only rank 0 reads `.grad` after backward, with clipping by norm (the ranks then hold
  whole gradients and shards respectively, and must still issue the same collectives);
- clock: a callback that only reads a clock (must cost dear nothing: no touch, every bucket applied
  in the forward).
"""

from __future__ import annotations

import copy
import io
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import commsched

warnings.filterwarnings("ignore", ".*does not have many workers.*")

STEPS = 8


class TouchyNet(pl.LightningModule):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.early = nn.Linear(6, 16)
        self.middle = nn.Linear(16, 16)
        self.late = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.grad_seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.early(x))
        if self.variant == "shared":  # `late` has not run yet: its weight is read outside its own forward
            h = h + 0.1 * F.linear(h, self.late.weight)
        h = torch.tanh(self.middle(h))
        return self.head(torch.tanh(self.late(h)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        l2 = sum((p * p).sum() for p in self.parameters()) if self.variant == "l2first" else 0.0
        return F.cross_entropy(self(x), y) + 1e-2 * l2

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.variant == "readers":  # reads and writes .grad, as a user's gradient hook would
            self.grad_seen.append(self.head.weight.grad.detach().clone())
            for p in self.parameters():
                p.grad.mul_(0.5)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.7), "interval": "step"},
        }

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
        return DataLoader(data, batch_size=4)


class GradNormOnRankZero(pl.Callback):
    """Reads every `.grad` after backward, on rank 0 only (a rank-zero logging habit)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.norms.append(sum(p.grad.norm().item() ** 2 for p in pl_module.parameters()) ** 0.5)


class StateReaderWeightWriter(pl.Callback):
    """After every step: reads the optimizer's momentum buffers, clamps the weights in place."""

    def __init__(self) -> None:
        self.momentum: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        self.momentum.append(optimizer.state[pl_module.middle.weight]["momentum_buffer"].clone())
        with torch.no_grad():
            for p in pl_module.parameters():
                p.data.clamp_(-0.35, 0.35)


class Snapshots(pl.Callback):
    """Every other step: a deep copy of the model and its state dict through torch.save."""

    def __init__(self) -> None:
        self.copies: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx % 2:
            clone = copy.deepcopy(pl_module)
            buffer = io.BytesIO()
            torch.save(pl_module.state_dict(), buffer)
            self.copies.append({k: v.detach().clone() for k, v in clone.state_dict().items()})
            buffer.seek(0)
            saved = torch.load(buffer)
            assert all(torch.equal(saved[k], v) for k, v in self.copies[-1].items())


class Clock(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter())


def callbacks_for(variant: str) -> list[pl.Callback]:
    if variant == "readers":
        return [GradNormOnRankZero(), StateReaderWeightWriter(), Snapshots()]
    if variant == "rankzero":
        return [GradNormOnRankZero()]
    if variant == "clock":
        return [Clock()]
    return []


def run(out: Path, case: str, world: int) -> None:
    variant, kind = case.split("-")
    pl.seed_everything(11, verbose=False)
    model = TouchyNet(variant)
    callbacks = callbacks_for(variant)
    strategy = (
        DDPStrategy(find_unused_parameters=False)
        if kind == "ddp"
        else commsched.DeARStrategy(
            bucket_cap_mb=700 / 2**20, trace_collectives=True, dear=commsched.DeAROptions(fallback="never")
        )
    )  # DeAR's touches, never WFBP
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        gradient_clip_val=0.5 if variant in ("readers", "rankzero") else None,
        callbacks=callbacks,
        default_root_dir=out / f"{case}-run",
    )
    trainer.fit(model)
    schedule = getattr(trainer.strategy, "last_schedule", None)
    result = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grad_seen": model.grad_seen,
        "norms": next((c.norms for c in callbacks if isinstance(c, GradNormOnRankZero)), []),
        "momentum": next((c.momentum for c in callbacks if isinstance(c, StateReaderWeightWriter)), []),
        "copies": next((c.copies for c in callbacks if isinstance(c, Snapshots)), []),
        "touches": schedule.deferred.pending.touches if schedule is not None else None,
        "buckets": len(schedule.plan.buckets) if schedule is not None else None,
        "applied": dict(schedule.deferred.applied) if schedule is not None else None,
        "trace": [tuple(vars(r).values()) for r in getattr(trainer.strategy, "collective_trace", [])],
    }
    torch.save(result, out / f"{case}.rank{trainer.global_rank}.pt")


def main() -> None:
    out, world, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        run(out, case, world)


if __name__ == "__main__":
    main()
