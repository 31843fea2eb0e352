"""`commsched-train` / `python -m commsched.train`: train from the command line, driven by Hydra.

    commsched-train schedule=dear model=resnet data=synthetic_images trainer.max_steps=100
    commsched-train -m schedule=ddp,wfbp,dear fusion.bucket_cap_mb=1,25     # a sweep

The configuration is validated here, before any worker process starts; the run itself happens in
`commsched.run`, in a fresh process. Each run directory gets config.resolved.yaml, the CSV logs,
metrics.json and summary.json, and the one-line summary is printed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from commsched import overrides
from commsched.config import TrainConfig, register_configs, validate
from commsched.plugins import import_plugins, plugins_in, schedule_names
from commsched.errors import CommSchedConfigError
from commsched.run_files import write_json


def summarise(cfg: Any, metrics: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    quality = {k: metrics[k] for k in ("train_loss", "val_loss", "val_acc", "val_ppl") if k in metrics}
    return {
        "schedule": str(cfg.schedule.name),
        "model": cfg.model.arch if cfg.model.kind == "image" else f"gpt2-{cfg.model.size}",
        "data": cfg.data.name,
        "fusion": metrics["fusion"]["ran"] if "fusion" in metrics else "Lightning's ddp buckets",
        "bucket_cap_mb": cfg.fusion.bucket_cap_mb if metrics.get("fusion", {}).get("ran", "").startswith("fixed") else None,
        "predicted_step_ms": metrics.get("fusion", {}).get("predicted_step_ms"),
        "world_size": metrics["world_size"],
        "steps": metrics["steps"],
        "samples_per_s": metrics["samples_per_s"],
        "step_ms": metrics["step_ms"],
        "exposed_comm_ms": metrics["exposed_comm_ms"],
        **quality,
        **({"deft_plan": metrics["deft"]["plan"], "deft_mu": metrics["deft"]["mu"]} if "deft" in metrics else {}),
        "overrides": " ".join(overrides),
    }


def summary_line(summary: dict[str, Any]) -> str:
    quality = ", ".join(f"{k} {summary[k]:.4f}" for k in ("train_loss", "val_loss", "val_acc", "val_ppl") if k in summary)
    return (
        f"commsched: {summary['schedule']} {summary['model']} on {summary['data']}, {summary['world_size']} workers: "
        f"{summary['samples_per_s']:.1f} samples/s ({summary['step_ms']:.1f} ms/step), {quality}"
        + (f"; deft {summary['deft_plan']}, mu {summary['deft_mu']:.2f}" if summary.get("deft_mu") is not None else "")
        + predicted_against_measured(summary)
    )


def predicted_against_measured(summary: dict[str, Any]) -> str:
    """A model-chosen plan's predicted step beside the measured one: how far to trust the model."""
    predicted = summary.get("predicted_step_ms")
    if not predicted:
        return ""
    off = (summary["step_ms"] / predicted - 1.0) * 100
    return f"; the plan's model predicted {predicted:.1f} ms/step, measured {summary['step_ms']:.1f} ({off:+.0f}%)"


_warned: set[str] = set()


def warn_if_oversubscribed(cfg: Any) -> None:
    """More CPU workers than cores: they take turns, and every figure measures the turns (said once
    per command, not per run of a sweep)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    devices = cfg.trainer.devices
    if cfg.trainer.accelerator == "cpu" and devices > cores and "cores" not in _warned:
        _warned.add("cores")
        print(f"commsched-train: warning: trainer.devices={devices} CPU workers on {cores} cores share them: "
              "steps are slower and timings measure the sharing", file=sys.stderr)


def run_to_the_end(resolved: Path, out: Path, devices: int, num_nodes: int) -> int:
    """Runs every rank of this node (`commsched.ranks`) and waits for them, however they end.
    Ctrl-C reaches them from the terminal (same process group) and they stop at a step every rank
    agrees on and save: this process must neither die first nor kill them, so it ignores SIGINT
    meanwhile; a SIGTERM sent to this process alone (`kill`, a scheduler) is passed on to them."""
    from commsched.ranks import Ranks

    ranks = Ranks(resolved, out, devices, num_nodes)
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: ranks.send(signal.SIGTERM))
    try:
        return ranks.wait()
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)


CONF = Path(__file__).parent / "conf"
log = logging.getLogger("commsched.train")


def main() -> Any:
    """Import plugins, then refuse unknown keys and group options (Hydra would accept and ignore some), then run."""
    try:
        plugins = plugins_in(sys.argv[1:])
        import_plugins(plugins)
        schedules = schedule_names(bool(plugins))
        register_configs(schedules)
        overrides.check(sys.argv[1:], TrainConfig, {**overrides.group_choices(CONF), "schedule": schedules}, "commsched-train")
    except CommSchedConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        return overrides.print_help_without_schemas(run_training)
    return run_training()


@hydra.main(version_base=None, config_path="conf", config_name="train")
def run_training(cfg: DictConfig) -> float:
    try:
        validate(cfg)
    except CommSchedConfigError as error:  # one line, no traceback: the message says what to change
        print(error, file=sys.stderr)
        sys.exit(2)
    warn_if_oversubscribed(cfg)
    out = Path(HydraConfig.get().runtime.output_dir)
    resolved = out / "config.resolved.yaml"
    written = resolved.with_name(f"{resolved.name}.{os.getpid()}")
    OmegaConf.save(cfg, written, resolve=True)
    os.replace(written, resolved)  # whole, never half-written: every node of a cluster writes it, others' ranks read it
    try:
        code = run_to_the_end(resolved, out, cfg.trainer.devices, cfg.trainer.num_nodes)
    except CommSchedConfigError as error:  # found where the ranks are started: the launch environment
        print(error, file=sys.stderr)
        sys.exit(2)
    if code in (130, -signal.SIGINT, -signal.SIGTERM):  # the run said where it stopped and what it saved
        sys.exit(130)
    if code != 0:
        print(f"commsched-train: the training run failed (exit code {code}); its output is above, "
              f"its files in {out}", file=sys.stderr)
        sys.exit(1)
    if os.environ.get("NODE_RANK", "0") != "0":  # a node of a cluster (commsched-cluster): node 0 reports
        return 0.0
    summary = summarise(cfg, json.loads((out / "metrics.json").read_text()), list(HydraConfig.get().overrides.task))
    write_json(out / "summary.json", summary, indent=2)
    log.info(f"{summary_line(summary)}; results in {out}")
    return float(summary["samples_per_s"])


if __name__ == "__main__":
    main()
