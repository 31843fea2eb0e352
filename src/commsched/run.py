"""The training run behind `commsched-train`: `python -m commsched.run CONFIG.yaml OUT_DIR`.

`commsched-train` (Hydra) composes and validates the configuration, writes it resolved to the run
directory and starts this module in a fresh process, which Lightning then re-launches for every
rank. Keeping Hydra out of the worker processes is what makes multi-runs (`-m`) work with
multi-process strategies. Rank 0 writes OUT_DIR/metrics.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import warnings
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from omegaconf import OmegaConf

import commsched  # noqa: F401  (registers the strategies)
import lightning.pytorch as pl
from commsched.builders import build_data, build_model, build_strategy
from commsched.callbacks import StepMetrics


def loggers(out: Path) -> list[Logger]:
    chosen: list[Logger] = [CSVLogger(out, name="", version="")]
    try:
        import tensorboard  # noqa: F401

        chosen.append(TensorBoardLogger(out, name="tensorboard", version=""))
    except ImportError:
        pass
    return chosen


def main() -> None:
    config_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = OmegaConf.load(config_file)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    pl.seed_everything(cfg.seed, verbose=False)
    model = build_model(cfg)
    data = build_data(cfg)
    t = cfg.trainer
    trainer = pl.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=build_strategy(cfg, out),
        max_steps=t.max_steps, max_epochs=t.max_epochs, precision=t.precision,
        accumulate_grad_batches=t.accumulate_grad_batches, gradient_clip_val=t.gradient_clip_val,
        val_check_interval=t.val_check_interval, limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps, enable_progress_bar=t.enable_progress_bar,
        logger=loggers(out), default_root_dir=out, enable_checkpointing=False,
    )
    samples_per_step = cfg.data.batch_size * trainer.world_size * t.accumulate_grad_batches
    metrics = StepMetrics(samples_per_step)
    trainer.callbacks.append(metrics)
    trainer.fit(model, datamodule=data)
    if not trainer.is_global_zero:
        return
    timed = metrics.step_seconds[cfg.warmup_steps :] or metrics.step_seconds
    step = statistics.median(timed)
    result = {
        **{k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
        "samples_per_s": samples_per_step / step,
        "step_ms": step * 1e3,
        "steps": trainer.global_step,
        "world_size": trainer.world_size,
        "exposed_comm_ms": statistics.median(metrics.exposed_ms[cfg.warmup_steps :]) if metrics.exposed_ms[cfg.warmup_steps :] else None,
        "step_ms_each": [s * 1e3 for s in metrics.step_seconds],  # shows when warm-up ended and when plans changed
    }
    (out / "metrics.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
