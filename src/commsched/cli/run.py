"""One rank of the training run behind `commsched-train`: `python -m commsched.cli.run CONFIG.yaml OUT_DIR`.

`commsched-train` (Hydra) composes and validates the configuration, writes it resolved to the run
directory and starts this module in a fresh process for every rank of its node at once
(`commsched.cli.ranks`), so that they import torch and Lightning side by side; Lightning takes them as
created outside it. Each rank loads the YAML back into the launcher's typed `TrainConfig`
(`commsched.cli.config.train_config`), whose options objects its strategy receives. Keeping Hydra
out of the worker processes is what makes multi-runs (`-m`) work with multi-process strategies.
Rank 0 writes OUT_DIR/metrics.json; Lightning's and commsched's messages also go to
OUT_DIR/train.log; checkpoints to OUT_DIR/checkpoints.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from omegaconf import OmegaConf

from commsched.cli.builders import build_data, build_model, build_strategy
from commsched.cli.config import TrainConfig, resume_path, train_config
from commsched.cli.quiet import quiet_lightning
from commsched.comm.local_workers import end_process_group
from commsched.plugins import import_plugins
from commsched.run_files import write_json
from commsched.runtime.callbacks import StepMetrics
from commsched.runtime.interrupt import StopAndSave, StoppedBySignal, end_if_shutdown_hangs


class RunProgressBar(RichProgressBar):
    """Lightning's rich bar, without "Epoch 0/-2" when the run is bounded by steps, not epochs."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 0:
            return f"Epoch {current_epoch}"
        return super()._get_train_description(current_epoch)


def loggers(out: Path) -> list[Logger]:
    chosen: list[Logger] = [CSVLogger(out, name="", version="")]
    try:
        import tensorboard  # noqa: F401

        chosen.append(TensorBoardLogger(out, name="tensorboard", version=""))
    except ImportError:
        pass
    return chosen


def checkpointing(cfg: TrainConfig, out: Path) -> Optional[ModelCheckpoint]:
    c = cfg.checkpoint
    if not c.enabled:
        return None
    return ModelCheckpoint(
        dirpath=out / "checkpoints",
        every_n_train_steps=c.every_n_steps or None,
        save_last=c.save_last,
        monitor=c.monitor,
        mode=c.mode,
        save_top_k=c.top_k if c.monitor else 0,
    )


def log_to_file(path: Path) -> None:
    """Lightning's and commsched's messages of this rank-0 process also go to the run's train.log."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    for name in ("lightning.pytorch", "commsched"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(min(logger.level or logging.INFO, logging.INFO))


@contextmanager
def interruptible(out: Path, stop: Optional[StopAndSave]) -> Iterator[None]:
    """Ctrl-C reaches every rank. Once training runs, `StopAndSave` stops every rank at one step and
    saves; before that, or at a second Ctrl-C, whatever the signal raises on any rank (Lightning's
    own shutdown, a peer gone in the middle of a collective) ends this process with 130 and one
    line, not with tracebacks."""
    interrupted = []

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.append(signum)
        end_if_shutdown_hangs(lambda: last_checkpoint(out))
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except BaseException as error:
        stopped = isinstance(error, StoppedBySignal)
        if not (stopped or interrupted or (stop is not None and stop.signals_seen)):
            raise
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"commsched: {interruption(error, out, stop)}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(130)  # skip interpreter teardown: backend threads of a half-torn-down process group can hang it
    finally:
        signal.signal(signal.SIGINT, previous)


def interruption(error: BaseException, out: Path, stop: Optional[StopAndSave]) -> str:
    """The one line an interrupted run ends with: where it stopped and how to go on."""
    if isinstance(error, StoppedBySignal):
        hint = stop.resume_hint(python=False) if stop is not None else None
        return (
            f"interrupted: stopped at step {error.step} and saved {error.saved}; "
            f"continue with: {hint or f'commsched-train resume={out} (and the same options)'}"
        )
    return f"interrupted at once, without saving; {last_checkpoint(out)}; logs in {out}"


def last_checkpoint(out: Path) -> str:
    last = out / "checkpoints" / "last.ckpt"
    return f"the last checkpoint is {last}" if last.is_file() else "no checkpoint was saved yet"


def fusion_ran(cfg: TrainConfig, strategy: Any) -> dict[str, Any]:
    """What fusion the run actually used (a plan file or a checkpoint's plan outranks the policy
    named in the config) and, if a model chose it, the step time that model predicted."""
    plan = getattr(strategy, "fusion_plan", None)
    buckets = getattr(strategy, "bucket_plan", None)
    count = len(buckets.buckets) if buckets is not None else (len(plan.buckets) if plan is not None else None)
    if plan is None:
        described = (
            f"{cfg.fusion.policy}, {cfg.fusion.bucket_cap_mb:g} MB"
            if cfg.fusion.policy in ("fixed", "bayes")
            else str(cfg.fusion.policy)
        )
    else:
        source = f"plan_file {cfg.fusion.plan_file}" if cfg.fusion.plan_file else f"{cfg.fusion.policy} decided"
        described = f"{source} ({plan.policy} plan)"
    if count is not None:
        described += f", {count} buckets"
    predicted = plan.predicted_s * 1e3 if plan is not None and plan.predicted_s else None
    return {"ran": described, "buckets": count, "predicted_step_ms": predicted}


def main() -> None:
    config_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    resolved = OmegaConf.load(config_file)
    import_plugins(resolved.get("plugins") or [])  # schedules registered from outside the package, as in the launcher
    cfg = train_config(resolved)  # typed once (plugin schedules' own nodes too): the options the strategy receives
    quiet_lightning()
    pl.seed_everything(cfg.seed, verbose=False)
    model = build_model(cfg)
    data = build_data(cfg)
    t = cfg.trainer
    checkpoint = checkpointing(cfg, out)
    callbacks: list[pl.Callback] = [checkpoint] if checkpoint is not None else []
    # last.ckpt at every epoch end (ModelCheckpoint writes `last` only beside a save of its own, and
    # with no monitor it saves nothing), at the run's final step, and at a step all ranks agree on when
    # Ctrl-C stops the run: one file, written through the ModelCheckpoint when it keeps `last`.
    stop = StopAndSave(command_line=True) if checkpoint is not None else None
    callbacks += [stop] if stop is not None else []
    if t.enable_progress_bar:
        callbacks.append(RunProgressBar())
    trainer = pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg, out),
        max_steps=t.max_steps,
        max_epochs=t.max_epochs,
        precision=t.precision,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        val_check_interval=t.val_check_interval,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        logger=loggers(out),
        default_root_dir=out,
        enable_checkpointing=checkpoint is not None,
        callbacks=callbacks,
    )
    if trainer.is_global_zero:
        log_to_file(out / "train.log")
    samples_per_step = cfg.data.batch_size * trainer.world_size * t.accumulate_grad_batches
    metrics = StepMetrics(samples_per_step)
    trainer.callbacks.append(metrics)
    ckpt_path = str(resume_path(cfg.resume)) if cfg.resume else None
    with interruptible(out, stop):
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    end_process_group()
    if not trainer.is_global_zero:
        return
    timed = metrics.step_seconds[cfg.warmup_steps :] or metrics.step_seconds
    step = statistics.median(timed) if timed else float("nan")
    exposed = metrics.exposed_ms[cfg.warmup_steps :] or metrics.exposed_ms
    result = {
        **{k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
        "samples_per_s": samples_per_step / step,
        "step_ms": step * 1e3,
        "steps": trainer.global_step,
        "world_size": trainer.world_size,
        "exposed_comm_ms": statistics.median(exposed) if exposed else None,
        "wire_mb_per_step": statistics.median(metrics.wire_mb[cfg.warmup_steps :] or metrics.wire_mb)
        if metrics.wire_mb
        else None,
        "step_ms_each": [s * 1e3 for s in metrics.step_seconds],  # shows when warm-up ended and when plans changed
        "checkpoints": str(out / "checkpoints") if checkpoint is not None else None,
    }
    if str(cfg.schedule.name) != "ddp":
        result["fusion"] = fusion_ran(cfg, trainer.strategy)
    schedule = getattr(trainer.strategy, "last_schedule", None)
    if hasattr(schedule, "report"):
        result["deft"] = schedule.report()
    write_json(out / "metrics.json", result, indent=2)


if __name__ == "__main__":
    main()
