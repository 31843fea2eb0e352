"""Run named training cases one after another in one set of worker processes; save what each ended with.

Usage: python run_cases.py OUT_DIR WORLD_SIZE CASE [CASE ...]

Lightning's subprocess launcher re-runs this script for ranks 1..N-1; later Trainers in the same
processes reuse the process group, so one invocation covers many cases. Each rank writes
OUT_DIR/<case>.rank<r>.pt with the final state dict, the collective trace and the losses.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import commsched  # noqa: F401  (registers "dear" and "wfbp")
from commsched import (
    DeAROptions,
    DeFTOptions,
    FusionOptions,
    LinkOptions,
    ProfileOptions,
    StreamOptions,
    TuningOptions,
)

sys.path.insert(0, str(Path(__file__).parent))
import extension_schedule  # noqa: E402,F401  (registers the "localsum" schedule)
from toy import ToyNet, UnfreezingToyNet  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*Checkpoint directory.*exists.*")

STEPS_PER_EPOCH = 12
ACCUMULATE = 2
BATCH = 4


class ReadsGradientsOnRankZero(pl.Callback):
    """A gradient-norm logger on rank 0 only, right after backward: DeAR's gradients are made whole there
    and not on the other ranks, which must not change which collectives each rank issues."""

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.norm = sum(float(p.grad.norm()) for p in pl_module.parameters() if p.grad is not None)


class SlowWhilePlanned(pl.Callback):
    """While the buckets are being decided, every step sleeps, twice as long on the planned layout: the
    planned layout measures clearly slower, and the sleeps dwarf this machine's noise in the steps' spread,
    so the run keeps fixed buckets whatever its timings would have said."""

    def __init__(self) -> None:
        self.fixed: str | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        layout = trainer.strategy.bucket_plan.describe()
        self.fixed = self.fixed or layout  # every run starts on fixed buckets
        if trainer.strategy.fusion_plan is None:  # still deciding
            time.sleep(0.3 if layout == self.fixed else 0.6)


class HookedDDP(DDPStrategy):
    """Lightning's DDP with its communication hook registered on CPU too (Lightning registers hooks on
    CUDA only; torch's DDP runs them over gloo as well): the reference for a low-precision wire."""

    def _register_ddp_hooks(self) -> None:
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


def make_strategy(kind: str, **options):
    if kind == "ddp":
        return (HookedDDP if "ddp_comm_hook" in options else DDPStrategy)(find_unused_parameters=True, **options)
    # 600-byte buckets: several buckets, sizes that no world size divides; DeAR never hands its iterations
    # to WFBP unless a case asks (these cases test DeAR itself)
    never = {"dear": DeAROptions(fallback="never")} if kind == "dear" else {}
    return commsched.CommSchedStrategy(
        schedule=kind, **{"bucket_cap_mb": 600 / 2**20, "trace_collectives": True, **never, **options}
    )


class PlanWatcher(pl.Callback):
    """The bucket layouts a run went through, in order (a planner changes it mid-run), and the
    schedule's communication state at the end; touches no weight, so the schedules keep their overlap."""

    def __init__(self, replan_at: int | None = None) -> None:
        self.layouts: list[str] = []
        self.ran: list[tuple[str, list[list[str]]]] = []  # (running schedule, its buckets by name), as they change
        self.comm_state: dict = {}
        self.replan_at = replan_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.replan_at and batch_idx % ACCUMULATE == 0:
            trainer.strategy.request_replan()  # e.g. the network changed: plan again
        plan = getattr(trainer.strategy, "bucket_plan", None)
        if plan is not None and (not self.layouts or self.layouts[-1] != plan.describe()):
            self.layouts.append(plan.describe())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        plan = getattr(trainer.strategy, "bucket_plan", None)
        if plan is not None:  # the schedule that ran this batch (a hand-over happens after the callbacks' batch start)
            running = (trainer.strategy.schedule.name, [list(b.names) for b in plan.buckets])
            if not self.ran or self.ran[-1] != running:
                self.ran.append(running)

    def on_train_end(self, trainer, pl_module) -> None:
        if getattr(trainer.strategy, "schedule", None) is not None:
            self.comm_state = trainer.strategy.schedule.state_dict()


def skipping_scaler() -> MixedPrecision:
    """fp16 with a GradScaler whose first scale overflows the toy's fp16 gradients: the first steps are
    skipped (the scale halves each time) before the others are taken, as a real run's first steps are."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**22))


def fit(
    out: Path,
    name: str,
    world: int,
    kind: str,
    optimizer: str = "sgd",
    epochs: int = 1,
    clip: str = "norm",
    precision: str = "32-true",
    resume_from: str | None = None,
    unfreeze: bool = False,
    replan_at: int | None = None,
    rank0_reads: bool = False,
    slow_while_planned: bool = False,
    **strategy_overrides,
) -> None:
    pl.seed_everything(1234, verbose=False)
    model_class = UnfreezingToyNet if unfreeze else ToyNet
    model = model_class(optimizer=optimizer, batch_size=BATCH, train_size=STEPS_PER_EPOCH * ACCUMULATE * BATCH * world)
    if "plan_file" in strategy_overrides:
        strategy_overrides["fusion"] = FusionOptions(plan_file=str(out / strategy_overrides.pop("plan_file")))
    strategy = make_strategy(kind, **strategy_overrides)
    watcher = PlanWatcher(replan_at)
    ckpt = ModelCheckpoint(dirpath=out / f"{name}-ckpt", save_last=True, save_top_k=0)
    scaled = precision == "16-mixed-skips"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        **({"plugins": [skipping_scaler()]} if scaled else {"precision": precision}),
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=None if clip == "none" else 0.5,
        gradient_clip_algorithm=None if clip == "none" else clip,
        limit_val_batches=2,
        val_check_interval=0.5,
        num_sanity_val_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt, watcher]
        + ([ReadsGradientsOnRankZero()] if rank0_reads else [])
        + ([SlowWhilePlanned()] if slow_while_planned else []),
        default_root_dir=out / name,
    )
    ckpt_path = str(out / f"{resume_from}-ckpt" / "last.ckpt") if resume_from else None
    validate_before = trainer.validate(model, verbose=False) if name.endswith("-eval") else None
    trainer.fit(model, ckpt_path=ckpt_path)
    trace = [tuple(vars(r).values()) for r in getattr(trainer.strategy, "collective_trace", [])]
    result = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "trace": trace,
        "global_step": trainer.global_step,
    }
    if getattr(trainer.strategy, "profile", None) is not None:
        result["profile"] = trainer.strategy.profile
    if getattr(trainer.strategy, "fusion_plan", None) is not None:
        result["fusion_plan"] = vars(trainer.strategy.fusion_plan)
        result["trials"] = trainer.strategy.tuning_trials
    if scaled:
        result["scale"] = trainer.precision_plugin.scaler.get_scale()  # below the first: steps were skipped
    result["layouts"] = watcher.layouts
    result["ran"] = watcher.ran
    result["comm_state"] = watcher.comm_state
    if name.endswith("-eval"):
        result["validate_before_fit"] = validate_before
        result["test"] = trainer.test(model, verbose=False)
        result["predict"] = torch.cat(trainer.predict(model))
    torch.save(result, out / f"{name}.rank{trainer.global_rank}.pt")


# the toy's gradients are ~2 KB: tune between 200 B and 2 KB so that trials give different buckets
BAYES = {
    "fusion": "bayes",
    "tuning": TuningOptions(
        trials=3, trial_steps=2, warmup_steps=1, min_mb=200 / 2**20, max_mb=2000 / 2**20, first_mb=600 / 2**20
    ),
}

# fusion="auto" within one 12-step epoch: 1 + 2 profiled steps, then 2 turns each of 1 + 1 steps
AUTO = FusionOptions(
    policy="auto", profile_warmup_steps=1, profile_steps=2, confirm_steps=1, confirm_rounds=2, confirm_max_rounds=2
)

QUICK_FALLBACK = DeAROptions(confirm_steps=1, confirm_rounds=1, confirm_max_rounds=1)

# torch's compress hooks; bf16's refuses CPU tensors, so its CPU reference is the body it wraps, with bf16
HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


def bf16_compress_hook_on_cpu(process_group, bucket):
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


CPU_HOOKS = {**HOOKS, "bf16": bf16_compress_hook_on_cpu}

# The plan itself every step (no hand-over to WFBP or DeAR): exactness of DeFT's own replay.
NO_DELAY = DeFTOptions(capacity=None, warmup_steps=1, measure_steps=2, cost_repeats=1, fallback="never")

CASES = {
    # name: (kind, kwargs)
    **{f"{kind}-{opt}": (kind, {"optimizer": opt}) for kind in ("ddp", "wfbp", "dear") for opt in ("sgd", "adamw")},
    "ddp-value": ("ddp", {"clip": "value"}),
    "dear-value": ("dear", {"clip": "value"}),
    "wfbp-value": ("wfbp", {"clip": "value"}),
    "ddp-bf16": ("ddp", {"precision": "bf16-mixed"}),
    "dear-bf16": ("dear", {"precision": "bf16-mixed"}),
    # fp16 with a GradScaler whose first steps overflow: skipped steps, then scaled ones, clipped by norm
    **{f"{kind}-fp16": (kind, {"precision": "16-mixed-skips"}) for kind in ("ddp", "wfbp", "dear")},
    "deft-fp16": ("deft", {"precision": "16-mixed-skips", "deft": NO_DELAY}),
    # a low-precision wire: DDP's compress hooks, and comm_dtype (or the same hook) under every schedule
    **{f"ddp-{w}hook": ("ddp", {"ddp_comm_hook": CPU_HOOKS[w]}) for w in ("bf16", "fp16")},
    **{f"{kind}-{w}wire": (kind, {"comm_dtype": w}) for kind in ("wfbp", "dear") for w in ("bf16", "fp16")},
    "deft-bf16wire": ("deft", {"comm_dtype": "bf16", "deft": NO_DELAY}),
    # unclipped: DeAR's clipping norm, summed from shards, can differ from torch's in its last bit, and a
    # 16-bit wire rounds that into a gradient's 16-bit value; without clipping nothing differs
    **{f"ddp-{w}hook-unclipped": ("ddp", {"ddp_comm_hook": CPU_HOOKS[w], "clip": "none"}) for w in ("bf16", "fp16")},
    **{f"dear-{w}wire-unclipped": ("dear", {"comm_dtype": w, "clip": "none"}) for w in ("bf16", "fp16")},
    "dear-bf16wire-streams-unclipped": (
        "dear",
        {"comm_dtype": "bf16", "clip": "none", "streams": StreamOptions(count=2, unit_mb=200 / 2**20)},
    ),
    "ddp-sgd-unclipped": ("ddp", {"clip": "none"}),
    "wfbp-bf16hook": ("wfbp", {"ddp_comm_hook": HOOKS["bf16"]}),
    "dear-bf16wire-streams": ("dear", {"comm_dtype": "bf16", "streams": StreamOptions(count=2, unit_mb=200 / 2**20)}),
    "dear-fp16-rank0-reads": ("dear", {"precision": "16-mixed-skips", "rank0_reads": True}),
    "dear-fp16-value": ("dear", {"precision": "16-mixed-skips", "clip": "value", "optimizer": "adamw"}),
    "ddp-fp16-value": ("ddp", {"precision": "16-mixed-skips", "clip": "value", "optimizer": "adamw"}),
    "dear-layers": ("dear", {"fusion": FusionOptions(policy="layers", bucket_layers=2)}),
    "dear-onebucket": ("dear", {"bucket_cap_mb": 25.0}),
    "dear-profiled": ("dear", {"profile": ProfileOptions(steps=5, probe=True)}),
    "dear-iface": ("dear", {"links": LinkOptions(primary_ifname="lo")}),  # the link's sockets on one interface
    # planners (world size 3): each changes the buckets mid-run; none may change the math
    "dear-mgwfbp": ("dear", {"fusion": FusionOptions(policy="mgwfbp", profile_steps=3)}),
    "dear-greedy": ("dear", {"fusion": FusionOptions(policy="mgwfbp-greedy", profile_steps=3)}),
    "wfbp-dear-model": ("wfbp", {"fusion": FusionOptions(policy="dear-model", profile_steps=3)}),
    "dear-planfile": ("dear", {"plan_file": "dear-mgwfbp/commsched_plan.json"}),
    # the default fusion: planned, then fixed and planned buckets take turns before one is kept
    "dear-auto": ("dear", {"fusion": AUTO}),
    "wfbp-auto": ("wfbp", {"fusion": AUTO}),
    "dear-bayes-1ep": ("dear", BAYES),
    "dear-bayes-resume": ("dear", {"epochs": 2, "resume_from": "dear-bayes-1ep", **BAYES}),
    "ddp-2ep": ("ddp", {"epochs": 2}),
    "dear-2ep": ("dear", {"epochs": 2}),
    # the default fallback, quick: after 5 steps DeAR and WFBP take turns (2 rounds of 1 + 1 steps), then the
    # faster runs the rest; the iterations change hands four times or more, the math never
    "dear-fallback-2ep": ("dear", {"epochs": 2, "dear": DeAROptions(confirm_steps=1, confirm_rounds=2)}),
    # the same choice made in the first epoch, checkpointed, resumed: kept, not measured again
    # (fixed buckets and one round of turns: the choice is made by step 9 of the 12)
    "dear-fallback-1ep": ("dear", {"epochs": 1, "fusion": "fixed", "dear": QUICK_FALLBACK}),
    "dear-fallback-resume": (
        "dear",
        {"epochs": 2, "resume_from": "dear-fallback-1ep", "fusion": "fixed", "dear": QUICK_FALLBACK},
    ),
    # DeAR's buckets planned for DeAR, WFBP's turns on the layout WFBP's own planner makes
    "dear-auto-fallback": (
        "dear",
        {"epochs": 2, "fusion": AUTO, "dear": DeAROptions(confirm_steps=1, confirm_rounds=2)},
    ),
    # the same, where the run keeps fixed buckets (its plan measured slower): WFBP's turns on fixed ones too
    "dear-auto-fallback-fixed": (
        "dear",
        {
            "epochs": 2,
            "fusion": AUTO,
            "dear": DeAROptions(confirm_steps=1, confirm_rounds=2),
            "slow_while_planned": True,
        },
    ),
    "wfbp-auto-resume": ("wfbp", {"epochs": 2, "resume_from": "wfbp-auto", "fusion": AUTO}),
    "wfbp-2ep": ("wfbp", {"epochs": 2}),
    "dear-1ep": ("dear", {"epochs": 1}),
    "ddp-1ep": ("ddp", {"epochs": 1}),
    "dear-resume": ("dear", {"epochs": 2, "resume_from": "dear-1ep"}),
    "ddp-from-dear": ("ddp", {"epochs": 2, "resume_from": "dear-1ep"}),
    "dear-from-ddp": ("dear", {"epochs": 2, "resume_from": "ddp-1ep"}),
    "wfbp-from-ddp": ("wfbp", {"epochs": 2, "resume_from": "ddp-1ep"}),
    "dear-eval": ("dear", {}),
    "dear-unfreeze": ("dear", {"unfreeze": True}),
    "dear-replan": (
        "dear",
        {"fusion": FusionOptions(policy="mgwfbp", profile_steps=2, profile_warmup_steps=1), "replan_at": 6},
    ),
    "wfbp-1ep": ("wfbp", {"epochs": 1}),
    "wfbp-resume": ("wfbp", {"epochs": 2, "resume_from": "wfbp-1ep"}),
    # a schedule added from outside (workers/extension_schedule.py) with per-rank state
    "localsum-1ep": ("localsum", {"epochs": 1}),
    "localsum-2ep": ("localsum", {"epochs": 2}),
    "localsum-resume": ("localsum", {"epochs": 2, "resume_from": "localsum-1ep"}),
    "localsum-bayes-2ep": ("localsum", {"epochs": 2, **BAYES}),
    # sub-group links, second stages requested after their first (workers/extension_schedule.py)
    "hier-sgd": ("hier", {"optimizer": "sgd"}),
    "wfbp-unfreeze": ("wfbp", {"unfreeze": True}),
    "ddp-eval": ("ddp", {}),
    # DeFT with room for everything (K = 1..1): DDP's updates over two links
    **{f"deft-{opt}": ("deft", {"optimizer": opt, "deft": NO_DELAY}) for opt in ("sgd", "adamw")},
    "deft-value": ("deft", {"clip": "value", "deft": NO_DELAY}),
    "deft-unfreeze": ("deft", {"unfreeze": True, "deft": NO_DELAY}),
}


def main() -> None:
    out, world, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        kind, kwargs = CASES[name]
        fit(out, name, world, kind, **kwargs)


if __name__ == "__main__":
    main()
