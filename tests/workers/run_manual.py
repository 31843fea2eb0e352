"""Manual optimization under each schedule, for test_manual_optimization.py.

Usage: python run_manual.py OUT_DIR CASE [CASE ...]   (a case: SCHEDULE-PATTERN)

SCHEDULE: ddp (Lightning's DDPStrategy, find_unused_parameters=True: a GAN's toggled-off half gets no
gradient), defaults (dear at its defaults), powersgd (wfbp with torch's powerSGD_hook, error feedback and warm
start: state kept per bucket, resumed into the buckets as cut), wfbp, dear (DeAR on every step, several
buckets), deft, streams (wfbp on 2 streams), topk (at a density that sends everything).
PATTERN:
- gan: Lightning's GAN recipe, two optimizers (Adam), `toggle_optimizer` / `untoggle_optimizer` around each
  half, BatchNorm in the generator, a generator step then a discriminator step on every batch;
- ganctx: the same with `LightningOptimizer.toggle_model()` and no toggling of requires_grad by hand, the
  discriminator's gradients from the generator's backward zeroed by `zero_grad` before its own;
- ganflags: the same with `requires_grad` switched by hand as CycleGAN's `set_requires_grad` does: each half
  switches the other off and itself on, and the discriminator's half leaves the generator off at the batch end;
- ganlate: gan with the generator's loss computed before toggling (the discriminator's parameters require a
  gradient in the forward and are switched off before the backward);
- ganhook: ganlate whose `on_before_backward` switches every parameter on (refused: after the ranks agreed which
  buckets no rank fills);
- ganlong: gan for 24 batches;
- ganbf16: gan under `precision="bf16-mixed"`; gancompiled: gan with both networks `compile()`d in place;
- ganfrozen: gan with the generator's last bias frozen from the start, still in its optimizer's parameters;
- single: one optimizer (SGD with momentum), `opt.step(closure=...)` running `manual_backward` inside,
  `self.clip_gradients` by norm, a per-step LR scheduler stepped by hand, a weight read after each step;
- accum: one optimizer, two micro-batches per step, the first inside `toggle_model(sync_grad=False)`;
- emptyclosure: `opt.step(closure=lambda: None)` (refused under dear: no gradients to step where it holds them);
- twice: one optimizer, two synchronised backwards per step (each averaged, as DDP averages each);
- localstep: one optimizer, `opt.step(closure=...)` inside `toggle_model(sync_grad=...)` as the docstring of
  `LightningOptimizer.step` writes it: every other step on this rank's own gradients (the ranks' weights part),
  the others on the average of the two batches' gradients.
A case ending in ``-resume`` trains half the steps, saves a checkpoint, and a new Trainer resumes from it to
the end (a `ResumableDataLoader`, so the resumed epoch goes on at the batch it had reached).

Every rank writes OUT_DIR/<case>.rank<r>.pt: the final weights and buffers, the optimizers' states, what the
module read after each step, and the collectives it issued (where traced).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.utils.data import TensorDataset

import commsched
from commsched.data import ResumableDataLoader

warnings.filterwarnings("ignore")
STEPS = 8
TINY_BUCKETS_MB = 0.0004  # a bucket or two per layer: several buckets for every schedule


class GAN(pl.LightningModule):
    """A small GAN on 8-dimensional points, trained by hand as Lightning's GAN example trains."""

    def __init__(self, toggle: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.reads: list[float] = []
        self.buffer_reads: list[float] = []  # the statistics each step's forward starts from (rank 0's under ddp)

    def _toggled(self, optimizer):
        if self.toggle == "ctx":
            return optimizer.toggle_model()
        if self.toggle == "flags":
            return _Flags(self, optimizer)
        return _Toggled(self, optimizer)

    def training_step(self, batch, batch_idx):
        (real,) = batch
        self.buffer_reads.append(float(self.generator[1].running_mean.double().sum()))
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(100 * self.global_rank + batch_idx))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        if self.toggle in ("late", "hook"):
            fake = self.generator(z)
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        with self._toggled(opt_g):
            if self.toggle not in ("late", "hook"):
                fake = self.generator(z)
                g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
        with self._toggled(opt_d):
            opt_d.zero_grad()  # ganctx: the generator's backward reached the discriminator too
            real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
            fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
            self.manual_backward((real_loss + fake_loss) / 2)
            opt_d.step()
            opt_d.zero_grad()
        self.reads.append(float(self.generator[0].weight.detach().double().sum()))
        self.log("g_loss", g_loss, prog_bar=True)

    def on_before_backward(self, loss) -> None:
        if self.toggle == "hook":
            for p in self.parameters():
                p.requires_grad_(True)

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
        )


class _Toggled:
    """`toggle_optimizer` / `untoggle_optimizer` around a block, as Lightning's GAN example writes them."""

    def __init__(self, module: pl.LightningModule, optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def __enter__(self) -> None:
        self.module.toggle_optimizer(self.optimizer)

    def __exit__(self, *exc) -> None:
        self.module.untoggle_optimizer(self.optimizer)


class _Flags:
    """`requires_grad` set by hand: on for the optimizer's half, off for the other, left so afterwards."""

    def __init__(self, module: GAN, optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def __enter__(self) -> None:
        mine = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        for p in self.module.parameters():
            p.requires_grad_(id(p) in mine)

    def __exit__(self, *exc) -> None:
        pass


class Classifier(pl.LightningModule):
    """An MLP with BatchNorm, one optimizer stepped by hand."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.pattern = pattern
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )
        self.reads: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        if self.pattern == "single":

            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(self.net(x), y)
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
                return loss

            opt.step(closure=closure)
            self.lr_schedulers().step()
        elif self.pattern == "emptyclosure":  # a closure with no backward: refused under dear
            opt.step(closure=lambda: None)
        elif self.pattern == "localstep":
            sync = batch_idx % 2 == 1

            def closure():
                loss = F.cross_entropy(self.net(x), y)
                self.manual_backward(loss)
                return loss

            with opt.toggle_model(sync_grad=sync):
                opt.step(closure=closure)
            if sync:
                opt.zero_grad()
        else:  # accum, twice: two micro-batches, the first kept local under accum
            half = x.shape[0] // 2
            with opt.toggle_model(sync_grad=self.pattern == "twice"):
                self.manual_backward(F.cross_entropy(self.net(x[:half]), y[:half]) / 2)
            self.manual_backward(F.cross_entropy(self.net(x[half:]), y[half:]) / 2)
            opt.step()
            opt.zero_grad()
        self.reads.append(float(self.net[0].weight.detach().double().sum()))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def strategy_for(schedule: str):
    if schedule == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    common = dict(bucket_cap_mb=TINY_BUCKETS_MB, trace_collectives=True)
    if schedule == "dear":
        return commsched.DeARStrategy(**common, dear=commsched.DeAROptions(fallback="never"))
    if schedule == "powersgd":  # one 25 MB bucket uncut, one per half once cut
        hook = powerSGD_hook.powerSGD_hook
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=7
        )
        return commsched.WFBPStrategy(
            bucket_cap_mb=25, trace_collectives=True, ddp_comm_hook=hook, ddp_comm_state=state
        )
    if schedule == "defaults":  # strategy="dear" with nothing else set (the trace aside)
        return commsched.DeARStrategy(trace_collectives=True)
    if schedule == "wfbp":
        return commsched.WFBPStrategy(**common)
    if schedule == "streams":
        return commsched.WFBPStrategy(**common, streams=commsched.StreamOptions(count=2))
    if schedule == "topk":
        return commsched.WFBPStrategy(
            **common, compression=commsched.CompressionOptions(method="topk", density=0.5, sparsity_warmup_steps=0)
        )
    if schedule == "deft":
        return commsched.DeFTStrategy(
            **common, deft=commsched.DeFTOptions(warmup_steps=1, measure_steps=1, cost_repeats=1)
        )
    raise ValueError(schedule)


def fit(case: str, out: Path) -> None:
    schedule, pattern = case.split("-", 1)
    resume = pattern.endswith("-resume")
    pattern = pattern.removesuffix("-resume")
    pl.seed_everything(5, verbose=False)
    g = torch.Generator().manual_seed(2)
    if pattern.startswith("gan"):
        model: pl.LightningModule = GAN(
            {"ganctx": "ctx", "ganflags": "flags", "ganlate": "late", "ganhook": "hook"}.get(pattern, "calls")
        )
        if pattern == "ganfrozen":
            model.generator[3].bias.requires_grad_(False)
        if pattern == "gancompiled":
            model.generator.compile()
            model.discriminator.compile()
        data = TensorDataset(torch.randn(160, 8, generator=g) * 0.5 + 1.0)
    else:
        model = Classifier(pattern)
        data = TensorDataset(torch.randn(160, 8, generator=g), torch.randint(0, 4, (160,), generator=g))
    batches = 3 * STEPS if pattern == "ganlong" else STEPS  # long enough for the defaults' profile to end
    steps = batches * (2 if pattern.startswith("gan") else 1)  # Lightning counts each optimizer's steps
    saved = out / f"{case}-half.ckpt"
    precision = "bf16-mixed" if pattern == "ganbf16" else "32-true"
    if resume:
        half = pl.Trainer(**trainer_args(strategy_for(schedule), steps // 2, out / f"{case}-half", precision))
        half.fit(model, ResumableDataLoader(data, batch_size=8))
        half.save_checkpoint(saved)
        pl.seed_everything(5, verbose=False)
        model = GAN(model.toggle) if pattern.startswith("gan") else Classifier(pattern)  # every weight from the file
    strategy = strategy_for(schedule)
    trainer = pl.Trainer(**trainer_args(strategy, steps, out / f"{case}-run", precision))
    trainer.fit(model, ResumableDataLoader(data, batch_size=8), ckpt_path=saved if resume else None)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizers = [strategy.optimizer_state(o) for o in trainer.optimizers]  # as a checkpoint holds them
    trace = [(r.link, r.op, r.tag, r.numel) for r in strategy.collective_trace] if schedule != "ddp" else []
    torch.save(
        {
            "state": state,
            "optimizers": optimizers,
            "reads": model.reads,
            "buffer_reads": getattr(model, "buffer_reads", []),
            "trace": trace,
            "buckets": [list(b.names) for b in strategy.last_schedule.plan.buckets] if schedule != "ddp" else [],
        },
        out / f"{case}.rank{trainer.global_rank}.pt",
    )


def trainer_args(strategy, steps: int, root: Path, precision: str = "32-true") -> dict:
    return dict(
        precision=precision,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[2:]:
        fit(case, out)


if __name__ == "__main__":
    main()
