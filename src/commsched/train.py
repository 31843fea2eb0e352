"""`commsched-train` / `python -m commsched.train`: train from the command line, driven by Hydra.

    commsched-train schedule=dear model=resnet data=synthetic_images trainer.max_steps=100
    commsched-train -m schedule=ddp,wfbp,dear fusion.bucket_cap_mb=1,25     # a sweep

The configuration is validated here, before any worker process starts; the run itself happens in
`commsched.run`, in a fresh process. Each run directory gets config.resolved.yaml, the CSV logs,
metrics.json and summary.json, and the one-line summary is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from commsched.config import register_configs, validate

register_configs()


def summarise(cfg: Any, metrics: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    quality = {k: metrics[k] for k in ("train_loss", "val_loss", "val_acc", "val_ppl") if k in metrics}
    return {
        "schedule": str(cfg.schedule.name),
        "model": cfg.model.arch if cfg.model.kind == "image" else f"gpt2-{cfg.model.size}",
        "data": cfg.data.name,
        "fusion": cfg.fusion.policy,
        "bucket_cap_mb": cfg.fusion.bucket_cap_mb,
        "world_size": metrics["world_size"],
        "steps": metrics["steps"],
        "samples_per_s": metrics["samples_per_s"],
        "step_ms": metrics["step_ms"],
        "exposed_comm_ms": metrics["exposed_comm_ms"],
        **quality,
        "overrides": " ".join(overrides),
    }


def summary_line(summary: dict[str, Any]) -> str:
    quality = ", ".join(f"{k} {summary[k]:.4f}" for k in ("train_loss", "val_loss", "val_acc", "val_ppl") if k in summary)
    return (
        f"commsched: {summary['schedule']} {summary['model']} on {summary['data']}, {summary['world_size']} workers: "
        f"{summary['samples_per_s']:.1f} samples/s ({summary['step_ms']:.1f} ms/step), {quality}"
    )


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    validate(cfg)
    out = Path(HydraConfig.get().runtime.output_dir)
    resolved = out / "config.resolved.yaml"
    OmegaConf.save(cfg, resolved, resolve=True)
    run = subprocess.run([sys.executable, "-m", "commsched.run", str(resolved), str(out)])
    if run.returncode != 0:
        raise SystemExit(f"commsched: the training run failed (exit code {run.returncode}); its output is above, its files in {out}")
    summary = summarise(cfg, json.loads((out / "metrics.json").read_text()), list(HydraConfig.get().overrides.task))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(summary_line(summary), flush=True)
    return float(summary["samples_per_s"])


if __name__ == "__main__":
    main()
