"""`commsched-train` / `python -m commsched.cli.train`: train from the command line, driven by Hydra.

    commsched-train schedule=dear model=resnet data=synthetic_images trainer.max_steps=100
    commsched-train -m schedule=ddp,wfbp,dear fusion.bucket_cap_mb=1,25     # a sweep

The configuration is converted once into the typed `TrainConfig` and validated here, before any
worker process starts; the run itself happens in `commsched.cli.run`, in a fresh process. Each run
directory gets config.resolved.yaml, the CSV logs, metrics.json and summary.json, and the one-line
summary is printed. A refused configuration leaves nothing behind: the run directory Hydra made
for it is removed again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from commsched.cli import overrides
from commsched.cli.config import (
    TrainConfig,
    register_configs,
    train_config,
    train_schedule_names,
    train_schema,
    validate,
)
from commsched.errors import CommSchedConfigError, use_syntax
from commsched.plugins import import_plugins, plugins_in
from commsched.run_files import write_json


def summarise(cfg: TrainConfig, metrics: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    quality = {k: metrics[k] for k in ("train_loss", "val_loss", "val_acc", "val_ppl") if k in metrics}
    return {
        "schedule": str(cfg.schedule.name),
        "model": cfg.model.arch if cfg.model.kind == "image" else f"gpt2-{cfg.model.size}",
        "data": cfg.data.name,
        "fusion": metrics["fusion"]["ran"] if "fusion" in metrics else "Lightning's ddp buckets",
        "bucket_cap_mb": cfg.fusion.bucket_cap_mb
        if metrics.get("fusion", {}).get("ran", "").startswith("fixed")
        else None,
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


def figure(value: Any, spec: str) -> str:
    """A figure of the summary, or "n/a" where metrics.json holds null (a step never timed, as in a
    resumed run that had no step left to take; a loss that was NaN)."""
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def summary_line(summary: dict[str, Any]) -> str:
    speed = (
        f"{figure(summary['samples_per_s'], '.1f')} samples/s ({figure(summary['step_ms'], '.1f')} ms/step)"
        if summary.get("step_ms") is not None
        else "no step timed"
    )
    quality = [
        f"{k} {figure(summary[k], '.4f')}" for k in ("train_loss", "val_loss", "val_acc", "val_ppl") if k in summary
    ]
    return (
        f"commsched: {summary['schedule']} {summary['model']} on {summary['data']}, {summary['world_size']} workers: "
        + ", ".join([speed, *quality])
        + (
            f"; deft {summary['deft_plan']}, mu {figure(summary['deft_mu'], '.2f')}"
            if summary.get("deft_mu") is not None
            else ""
        )
        + predicted_against_measured(summary)
    )


def predicted_against_measured(summary: dict[str, Any]) -> str:
    """A model-chosen plan's predicted step beside the measured one: how far to trust the model."""
    predicted = summary.get("predicted_step_ms")
    if not predicted or figure(summary.get("step_ms"), ".1f") == "n/a":
        return ""
    off = (summary["step_ms"] / predicted - 1.0) * 100
    return f"; the plan's model predicted {predicted:.1f} ms/step, measured {summary['step_ms']:.1f} ({off:+.0f}%)"


_warned: set[str] = set()


def warn_if_oversubscribed(cfg: TrainConfig) -> None:
    """More CPU workers than cores: they take turns, and every figure measures the turns (said once
    per command, not per run of a sweep)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    devices = cfg.trainer.devices
    if cfg.trainer.accelerator == "cpu" and devices > cores and "cores" not in _warned:
        _warned.add("cores")
        print(
            f"commsched: warning: trainer.devices={devices} CPU workers on {cores} cores share them: "
            "steps are slower and timings measure the sharing",
            file=sys.stderr,
        )


def run_to_the_end(resolved: Path, out: Path, devices: int, num_nodes: int) -> int:
    """Runs every rank of this node (`commsched.cli.ranks`) and waits for them, however they end.
    Ctrl-C reaches them from the terminal (same process group) and they stop at a step every rank
    agrees on and save: this process must neither die first nor kill them, so it ignores SIGINT
    meanwhile; a SIGTERM sent to this process alone (`kill`, a scheduler) is passed on to them."""
    from commsched.cli.ranks import Ranks

    ranks = Ranks(resolved, out, devices, num_nodes)
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: ranks.send(signal.SIGTERM))
    try:
        return ranks.wait()
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)


CONF = Path(__file__).parents[1] / "conf"  # commsched/conf, beside this folder
log = logging.getLogger("commsched.cli.train")

ABOUT = """\
commsched-train trains a model on N processes (trainer.devices=N, CPU or GPU) with a commsched
communication schedule (wfbp, dear, deft) or Lightning's own ddp, from a configuration composed of
one option per group below, any key of which the command line overrides; -m sweeps a list of values.
Everything is checked before any worker starts; each run writes its logs, metrics.json and
summary.json to its own folder (outputs/DATE/TIME, or multirun/DATE/TIME/N) and prints one line.

    commsched-train schedule=dear model=resnet trainer.devices=2
    commsched-train -m schedule=ddp,wfbp,dear fusion.bucket_cap_mb=1,25      # a sweep: 6 runs
"""

HYDRA_ROOTS = ("outputs", "multirun")
"""The folders of the working directory that Hydra's default run and sweep directories go in."""
HYDRA_FILES = frozenset({"config.yaml", "hydra.yaml", "overrides.yaml"})
"""What Hydra writes into a run's `.hydra` before the run starts."""


class Before:
    """The directories that existed before Hydra made this command's run directory, where that can be
    known: Hydra's default roots to the depth of their DATE/TIME folders, and the folders a literal
    `hydra.run.dir=` or `hydra.sweep.dir=` names, with their parents. A refused run removes only
    folders it can tell Hydra made for it."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.roots = [cwd / root for root in HYDRA_ROOTS]
        self.named: set[Path] = set()
        for arg in argv:
            key, _, value = arg.lstrip("+").partition("=")
            if key in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
                path = Path(os.path.abspath(cwd / value))
                self.named |= {path, *path.parents}
        self.existed = {p for p in self.named if p.is_dir()}
        for root in self.roots:
            if root.is_dir():
                self.existed.add(root)
                for child in _folders(root):
                    self.existed |= {child, *_folders(child)}

    def known(self, path: Path) -> bool:
        """Whether `existed` says for certain whether `path` existed."""
        return path in self.named or any(
            path == root or (root in path.parents and len(path.relative_to(root).parts) <= 2) for root in self.roots
        )


def _folders(path: Path) -> list[Path]:
    try:
        return [Path(entry.path) for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


_before: Optional[Before] = None


def _only_hydra_files(folder: Path, log_name: str, hydra_subdir: Optional[str]) -> bool:
    """Whether `folder` holds nothing but what Hydra writes before a run: its `.hydra` files and an
    empty log."""
    for entry in folder.iterdir():
        if entry.is_symlink():
            return False
        if entry.name == log_name and entry.is_file() and entry.stat().st_size == 0:
            continue
        if (
            entry.name == hydra_subdir
            and entry.is_dir()
            and all(f.name in HYDRA_FILES and f.is_file() and not f.is_symlink() for f in entry.iterdir())
        ):
            continue
        return False
    return True


def remove_run_folder(out: Path) -> None:
    """Remove what Hydra made for a run that was refused before it started: the run directory, when
    it holds only Hydra's `.hydra` files and an empty log; a sweep's folder (multirun.yaml alone)
    when no job of it left anything; then the parents that are left empty, up to the first that
    existed before this command (never the working directory or above it, never a folder whose past
    is not known). Anything else in any of them keeps it; nothing here makes a refusal fail. A node
    of a cluster other than node 0 leaves the folder to node 0, with which it may share it."""
    if os.environ.get("NODE_RANK", "0") != "0":
        return
    hydra_cfg = HydraConfig.get()
    cwd = Path(hydra_cfg.runtime.cwd)
    sweep = (
        out.parents[len(Path(str(hydra_cfg.sweep.subdir)).parts) - 1] if hydra_cfg.mode == RunMode.MULTIRUN else None
    )
    log_name = f"{hydra_cfg.job.name}.log"
    folder = out
    try:
        while folder != cwd and folder not in cwd.parents and folder.parent != folder:
            existed = _before is not None and folder in _before.existed
            if folder == out:
                if not _only_hydra_files(folder, log_name, hydra_cfg.output_subdir):
                    return
                for entry in folder.iterdir():
                    if entry.is_dir():
                        for file in entry.iterdir():
                            file.unlink()
                        entry.rmdir()
                    else:
                        entry.unlink()
            elif folder == sweep:
                entries = list(folder.iterdir())
                if [e.name for e in entries] not in ([], ["multirun.yaml"]) or any(
                    e.is_symlink() or not e.is_file() for e in entries
                ):
                    return
                for entry in entries:
                    entry.unlink()
            elif _before is None or not _before.known(folder):
                return
            if existed:  # named on the command line and there before: emptied of Hydra's files, kept
                return
            folder.rmdir()  # refuses a folder that is not empty: another run's, made meanwhile
            folder = folder.parent
    except OSError:  # another process's file appeared or went: what is left stays
        return


def refuse(error: CommSchedConfigError, out: Optional[Path] = None) -> None:
    """One line, no traceback (the message says what to change), exit code 2; a run folder Hydra made
    for the refused configuration is removed again."""
    print(error, file=sys.stderr)
    if out is not None:
        remove_run_folder(out)
    sys.exit(2)


def check_launch_and_files(cfg: TrainConfig) -> None:
    """What `validate` leaves to the run, checked before anything is written: the launch environment
    (a cluster node's `NODE_RANK` without `trainer.num_nodes`), a plan file (against the model, built on
    the meta device) and the numbers of a DeFT timings file."""
    from commsched.cli.ranks import rank_environments

    rank_environments(cfg.trainer.devices, cfg.trainer.num_nodes)
    if cfg.fusion.plan_file is not None:
        from commsched.cli.builders import check_plan_file

        check_plan_file(cfg)
    if cfg.deft.timings_file is not None:
        from commsched.deft.measure import check_timings_file

        check_timings_file(str(Path(cfg.deft.timings_file).expanduser()))


def main() -> Any:
    """Import plugins, then refuse unknown keys and group options (Hydra would accept and ignore some), then run."""
    global _before
    use_syntax("hydra")  # refusals name settings as this command line spells them, under python -m too
    try:
        plugins = plugins_in(sys.argv[1:])
        import_plugins(plugins)
        schedules = train_schedule_names(bool(plugins))
        schema = train_schema(bool(plugins))
        register_configs(schedules, schema)
        groups = {**overrides.group_choices(CONF), "schedule": schedules}
        overrides.check(sys.argv[1:], schema, groups)
    except CommSchedConfigError as error:
        refuse(error)
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        return overrides.print_help(ABOUT, "commsched-train", CONF, "train", groups, sys.argv[1:])
    _before = Before(sys.argv[1:], Path.cwd())
    return run_training()


@hydra.main(version_base=None, config_path="../conf", config_name="train")
def run_training(cfg: DictConfig) -> float:
    out = Path(HydraConfig.get().runtime.output_dir)
    train = train_config(cfg)  # converted once; `cfg` stays Hydra's: saved below, each rank loads it back typed
    try:
        validate(train)
        check_launch_and_files(train)
    except CommSchedConfigError as error:
        refuse(error, out)
    warn_if_oversubscribed(train)
    resolved = out / "config.resolved.yaml"
    written = resolved.with_name(f"{resolved.name}.{os.getpid()}")
    OmegaConf.save(cfg, written, resolve=True)
    os.replace(written, resolved)  # whole, never half-written: every node of a cluster writes it, others' ranks read it
    try:
        code = run_to_the_end(resolved, out, train.trainer.devices, train.trainer.num_nodes)
    except CommSchedConfigError as error:  # found where the ranks are started (checked above already)
        refuse(error)
    if code in (130, -signal.SIGINT, -signal.SIGTERM):  # the run said where it stopped and what it saved
        sys.exit(130)
    if code != 0:
        print(
            f"commsched: the training run failed (exit code {code}); its output is above, its files in {out}",
            file=sys.stderr,
        )
        sys.exit(1)
    if os.environ.get("NODE_RANK", "0") != "0":  # a node of a cluster (commsched-cluster): node 0 reports
        return 0.0
    summary = summarise(train, json.loads((out / "metrics.json").read_text()), list(HydraConfig.get().overrides.task))
    write_json(out / "summary.json", summary, indent=2)
    log.info(f"{summary_line(summary)}; results in {out}")
    return float(summary["samples_per_s"]) if summary["samples_per_s"] is not None else math.nan


if __name__ == "__main__":
    main()
