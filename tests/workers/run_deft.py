"""DeFT runs whose plan is forced by a timings file, for the single-process replay in test_deft.py.

Usage: python run_deft.py OUT_DIR WORLD_SIZE CASE [CASE ...]

Each rank writes OUT_DIR/<case>.rank<r>.pt: the initial and final weights, the plan replayed, the
collective trace and the Preserver's decisions. The model is a small MLP on fixed data without
shuffling, so the test can recompute every rank's gradient of every iteration in one process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import TensorDataset

import commsched
from commsched.data.base import ResumableLoader

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*Checkpoint directory.*exists.*")

BATCH = 4
SEED = 99
SAMPLES = 256
ACCELERATOR = os.environ.get("COMMSCHED_TEST_ACCELERATOR", "cpu")
"""Where the runs train: the CPU over gloo, or "gpu" over NCCL in the GPU suite (tests/gpu)."""
BUCKET_MB = 64 / 2**20  # the MLP's ~1.8 KB of gradients in 5 buckets (each closes once it holds 64 bytes)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


class MLP(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.parameters())

    def train_dataloader(self):
        # one epoch covers every run here: a resumed run starts at the batch the checkpoint had reached
        return ResumableLoader(data(), batch_size=BATCH, shuffle=False, skip_batches=self.trainer.global_step)


def make_optimizer(name: str, params) -> dict:
    if name in ("sgd", "sgd-hot"):  # hot: a step large enough that a stale plan raises the loss
        opt = torch.optim.SGD(params, lr=0.2 if name == "sgd" else HOT_LR, momentum=0.9)
    elif name in ("sgd-groups", "sgd-nesterov"):  # weights decayed, biases not, with another momentum (DGC's cases)
        params = list(params)
        nesterov = name == "sgd-nesterov"
        opt = torch.optim.SGD(
            [
                {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.05},
                {"params": [p for p in params if p.dim() <= 1], "momentum": 0.5},
            ],
            lr=0.2,
            momentum=0.9,
            nesterov=nesterov,
        )
    else:
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# forward 1 s, backward 0.3 s per bucket, all-reduce 1 s (primary) and 1.2 s (secondary) per bucket:
# communication is three times what compute can hide, so the plan must delay and use both links
def timings(buckets: int) -> dict:
    return {"forward": 1.0, "backward": [0.3] * buckets, "costs": [[1.0] * buckets, [1.2] * buckets]}


HOT_LR = 1.0

COMPENSATION = {"spike": "spike", "predict": "predict", "both": "spike+predict", "auto": "auto"}
"""What the forced cases named forced-<key>... (and preserved-auto) compensate."""

CASES = {
    # name: (optimizer, steps, resume_from, preserver (None, or steps between re-checks), capacity)
    "forced-sgd": ("sgd", 17, None, None, 1.0),
    "forced-adamw": ("adamw", 17, None, None, 1.0),
    "forced-sgd-part": ("sgd", 9, None, None, 1.0),
    "forced-sgd-resumed": ("sgd", 17, "forced-sgd-part", None, 1.0),
    # spike compensation of the late generations, two param groups (their own momentum and decay)
    "forced-spike": ("sgd-groups", 17, None, None, 1.0),
    "forced-spike-part": ("sgd-groups", 9, None, None, 1.0),
    "forced-spike-resumed": ("sgd-groups", 17, "forced-spike-part", None, 1.0),
    # linear weight prediction (any optimizer), and both compensations with a resume between
    "forced-predict": ("adamw", 17, None, None, 1.0),
    "forced-both": ("sgd-groups", 17, None, None, 1.0),
    "forced-both-part": ("sgd-groups", 9, None, None, 1.0),
    "forced-both-resumed": ("sgd-groups", 17, "forced-both-part", None, 1.0),
    "preserved": ("sgd", 12, None, 0, 1.0),
    "preserved-stale": (
        "sgd",
        12,
        None,
        0,
        1.0,
    ),  # one iteration of staleness allowed, uncompensated: judged by curvature
    "preserved-auto": ("sgd", 12, None, 0, 1.0),  # max_staleness=1, the compensation's default ("auto")
    "undelayed-two-links": (
        "sgd",
        12,
        None,
        None,
        50.0,
    ),  # room for everything on both links: no delay, the plan itself
    "rechecked": ("sgd", 16, None, 8, 0.5),
    "profiled": ("sgd", 12, None, None, 1.0),  # the profile covers measured and planned steps
    # measured (no timings file), nothing delayed, handed to DeAR's decoupling after the measured steps
    "handed-sgd": ("sgd", 17, None, None, None),
    "handed-sgd-part": ("sgd", 9, None, None, None),
    "handed-sgd-resumed": ("sgd", 17, "handed-sgd-part", None, None),
    # the same from a timings file whose halves make DeAR over both links the fastest (adamw: per-bucket steps)
    "handed-two-links": ("adamw", 12, None, None, None),
    # nothing delayed, DeAR's halves (from the timings file) too slow: WFBP runs DDP's schedule
    "handed-wfbp": ("sgd", 12, None, None, None),
    # the same prediction, but WFBP's real steps are slow (a callback sleeps in them): timing both overrules it
    "confirmed-dear": ("sgd", 20, None, None, None),  # 3 steps, then WFBP and DeAR twice each for 1 + 2 steps
    "confirmed-delayed": (
        "sgd",
        32,
        None,
        None,
        1.0,
    ),  # a delayed plan and WFBP take turns (twice each, more within the noise): the plan comes back
    # a one-step-stale plan (compensation "auto") watched for WATCH iterations: its loss fell, or did not
    # (then it is stopped, rolled back or not, and DeFT measures and solves again without staleness);
    # 13 steps: float rounding grows by about 1.5x a step at the hot learning rate
    "watched-kept": ("sgd", 13, None, 0, 1.0),
    "watched-stopped": ("sgd-hot", 13, None, 0, 1.0),
    "watched-drained": ("sgd-hot", 13, None, 0, 1.0),
    "watched-stopped-part": ("sgd-hot", 5, None, 0, 1.0),  # saved inside the window
    "watched-stopped-resumed": ("sgd-hot", 13, "watched-stopped-part", 0, 1.0),
    "watched-stopped-late-part": ("sgd-hot", 6, None, 0, 1.0),  # saved after the window's last iteration
    "watched-stopped-late-resumed": ("sgd-hot", 13, "watched-stopped-late-part", 0, 1.0),
    "watched-drained-late-part": ("sgd-hot", 6, None, 0, 1.0),
    "watched-drained-late-resumed": ("sgd-hot", 13, "watched-drained-late-part", 0, 1.0),
    # re-checked every 6 steps: the first stale plan is solved again as its window ends (not judged),
    # the second is judged against the 2 iterations measured since
    "watched-rechecked": ("sgd-hot", 14, None, 6, 1.0),
    # stale plans wait until step 6: an exact plan until then, solved again at 6, stale from 8
    "watched-waiting": ("sgd-hot", 14, None, 0, 1.0),
    "watched-epoch": ("sgd-hot", 6, None, 0, 1.0),  # stale_after_steps left at its default: one epoch
}

WATCH = 3
"""Iterations a stale plan is watched in the watched-* cases (as many as the synchronous ones before it)."""


class ReadsWeights(pl.Callback):
    """Looks at the weights after every batch (as EMA or a logger of weight norms would)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.norms.append(float(sum(p.detach().norm() for p in pl_module.parameters())))


class PlanHistory(pl.Callback):
    """What ran each batch: (batch index, DeFT's replay index or None while measuring, the plan as JSON)."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, object, dict]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        deft = trainer.strategy._engine.owner
        replayed = deft.iteration - 1 if deft.decided and deft.choice.runs == "plan" else None
        self.batches.append((trainer.global_step, replayed, deft.deft_plan.to_json()))


class SlowUnder(pl.Callback):
    """Sleeps in every step the named schedule runs: a cost the prediction cannot see."""

    def __init__(self, schedule: str, seconds: float) -> None:
        self.schedule, self.seconds = schedule, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        running = trainer.strategy._engine.schedule
        if running is not None and running.name == self.schedule:
            time.sleep(self.seconds)


def halves(buckets: int, seconds: float = 0.4) -> dict:
    """DeAR's halves `seconds` a bucket on either link (0.4: two chains of all-gathers beat one)."""
    return {"reduce_scatter": [[seconds] * buckets] * 2, "all_gather": [[seconds] * buckets] * 2}


def fit(out: Path, name: str, world: int) -> None:
    optimizer, steps, resume_from, preserve, capacity = CASES[name]
    pl.seed_everything(SEED, verbose=False)
    model = MLP(optimizer)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    buckets = commsched_bucket_count(model)
    timings_file = out / "timings.json"
    timings_file.write_text(json.dumps(timings(buckets)))
    if name == "handed-two-links":
        timings_file.write_text(json.dumps({**timings(buckets), **halves(buckets)}))
        options = commsched.DeFTOptions(
            warmup_steps=1,
            measure_steps=2,
            cost_repeats=1,
            capacity=None,
            timings_file=str(timings_file),
            confirm_steps=0,
        )
    elif name in ("handed-wfbp", "confirmed-dear", "confirmed-delayed"):
        timings_file.write_text(json.dumps({**timings(buckets), **halves(buckets, seconds=30.0)}))
        options = commsched.DeFTOptions(
            warmup_steps=1,
            measure_steps=2,
            cost_repeats=1,
            capacity=capacity,
            timings_file=str(timings_file),
            confirm_steps=0 if name == "handed-wfbp" else 2,
        )
    elif name == "undelayed-two-links":
        options = commsched.DeFTOptions(
            warmup_steps=1,
            measure_steps=2,
            cost_repeats=1,
            capacity=capacity,
            timings_file=str(timings_file),
            fallback="never",
        )
    elif name.startswith("handed"):
        options = commsched.DeFTOptions(
            warmup_steps=1, measure_steps=2, cost_repeats=1, capacity=None, fallback="when_undelayed"
        )
    else:
        options = commsched.DeFTOptions(
            warmup_steps=1,
            measure_steps=2,
            cost_repeats=1,
            capacity=capacity,
            timings_file=str(timings_file),
            compensation="auto"
            if name.startswith("watched")
            else COMPENSATION.get((name.split("-") + [""])[1], "none"),
        )
    profile = commsched.ProfileOptions(steps=9, dir=str(out / f"{name}-profile")) if name == "profiled" else None
    # Cases without a Preserver of their own run their forced plans unguarded, as asked.
    strategy = commsched.DeFTStrategy(
        bucket_cap_mb=BUCKET_MB,
        deft=options,
        trace_collectives=True,
        profile=profile,
        preserver=commsched.PreserverOptions(enabled=preserve is not None),
    )
    callbacks = [ModelCheckpoint(dirpath=out / f"{name}-ckpt", every_n_train_steps=1, save_top_k=-1)]
    staleness, margin = (1, 1.0) if name == "preserved-stale" else (0, 0.0)
    # stale plans start at once here (the default waits one epoch), except where the case is the wait
    preserver = (
        commsched.Preserver(max_staleness=1, stale_after_steps=0)
        if name == "preserved-auto"
        else commsched.Preserver(
            max_staleness=1,
            watch_steps=WATCH,
            rollback=not name.startswith("watched-drained"),
            recheck_every_n_steps=preserve,
            stale_after_steps={"watched-waiting": 6, "watched-epoch": None}.get(name, 0),
        )
        if name.startswith("watched")
        else commsched.Preserver(
            recheck_every_n_steps=preserve, max_staleness=staleness, curvature_margin=margin, stale_after_steps=0
        )
        if preserve is not None
        else None
    )
    if preserver is not None:
        callbacks.append(preserver)
    if name == "confirmed-dear":
        callbacks.append(SlowUnder("wfbp", 0.3))
    history = PlanHistory()
    callbacks.append(history)
    if (
        name.startswith("handed") or name == "confirmed-dear"
    ):  # DeAR stays exact (and keeps its overlap) whatever a callback reads
        callbacks.append(ReadsWeights())
    trainer = pl.Trainer(
        accelerator=ACCELERATOR,
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=out / name,
        num_sanity_val_steps=0,
    )
    ckpt = str(out / f"{resume_from}-ckpt" / f"epoch=0-step={CASES[resume_from][1]}.ckpt") if resume_from else None
    hooks: list = []
    handles = (
        [
            register_optimizer_step_pre_hook(lambda opt, args, kwargs: record("pre", opt, hooks)),
            register_optimizer_step_post_hook(lambda opt, args, kwargs: record("post", opt, hooks)),
        ]
        if name == "forced-spike"
        else []
    )
    try:
        trainer.fit(model, ckpt_path=ckpt)
    finally:
        for handle in handles:
            handle.remove()
    result = {
        "initial": initial,
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "trace": [tuple(vars(r).values()) for r in trainer.strategy.collective_trace],
        "plan": trainer.strategy.deft_plan.to_json(),
        "sync_steps": 3,
        "steps": steps,
        "world": world,
        "device": str(trainer.strategy.root_device),
        "seed": SEED,
        "decisions": preserver.decisions if preserver is not None else [],
        "optimizer": optimizer,
        "history": history.batches,
        "report": trainer.strategy.last_schedule.report(),
        "hooks": hooks,
    }
    torch.save(result, out / f"{name}.rank{trainer.global_rank}.pt")


def record(kind: str, optimizer: torch.optim.Optimizer, calls: list) -> None:
    """What a global step hook sees (forced-spike): the first group's weight decay and the weights."""
    weights = sum(float(p.detach().double().sum()) for group in optimizer.param_groups for p in group["params"])
    calls.append((kind, optimizer.param_groups[0]["weight_decay"], weights))


def commsched_bucket_count(model: nn.Module) -> int:
    """Buckets the strategy will build: every parameter in backward order, closed at BUCKET_MB (first at 1 MiB as
    DDP)."""
    from commsched.comm.buckets import build_plan
    from commsched.options import FusionOptions
    from commsched.planning.policy import PlanPolicy

    planner = PlanPolicy(FusionOptions(bucket_cap_mb=BUCKET_MB), commsched.TuningOptions()).planner()
    return len(build_plan(model, 1, planner).buckets)


def main() -> None:
    out, world, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        fit(out, name, world)


if __name__ == "__main__":
    main()
