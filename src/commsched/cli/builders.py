"""Turn a validated run configuration (`TrainConfig`, converted from Hydra's once) into the model,
data module and strategy it names; the strategy receives the configuration's options objects."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, Strategy

import commsched
from commsched.cli.config import TrainConfig, own_nodes
from commsched.data import ByteTextData, Cifar10Data, DigitsData, SyntheticImageData, SyntheticTokenData
from commsched.models import ImageClassifier, LanguageModel

VOCAB_SIZE = 256  # every token source here is bytes (or random bytes)


def build_model(cfg: TrainConfig) -> pl.LightningModule:
    m = cfg.model
    common = dict(
        optimizer=m.optimizer, lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, lr_schedule=m.lr_schedule
    )
    if m.kind == "image":
        num_classes = 10 if cfg.data.name in ("cifar10", "digits") else m.num_classes
        return ImageClassifier(arch=m.arch, num_classes=num_classes, cifar=m.cifar, width=m.width, **common)
    return LanguageModel(
        size=m.size,
        vocab_size=VOCAB_SIZE if m.size == "tiny" else None,
        block_size=cfg.data.block_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        **common,
    )


def build_data(cfg: TrainConfig) -> pl.LightningDataModule:
    d = cfg.data
    if d.name == "synthetic_images":
        return SyntheticImageData(
            d.batch_size, d.train_size, d.val_size, d.resolution, cfg.model.num_classes, d.seed, d.num_workers
        )
    if d.name == "synthetic_tokens":
        return SyntheticTokenData(
            d.batch_size, d.train_size, d.val_size, d.block_size, VOCAB_SIZE, d.seed, d.num_workers
        )
    if d.name == "cifar10":
        return Cifar10Data(d.dir, d.batch_size, num_workers=d.num_workers)
    if d.name == "digits":
        return DigitsData(d.batch_size, d.resolution, seed=d.seed, num_workers=d.num_workers)
    return ByteTextData(d.path, d.block_size, d.batch_size, num_workers=d.num_workers)


def build_strategy(cfg: TrainConfig, out: Optional[Path] = None) -> Strategy:
    """`out`: the run directory; profiles go to out/profile."""
    name = str(cfg.schedule.name)
    timeout = timedelta(seconds=cfg.trainer.timeout_s)
    if name == "ddp":
        ddp = dict(bucket_cap_mb=cfg.fusion.bucket_cap_mb, find_unused_parameters=False, timeout=timeout)
        if cfg.comm_dtype != "fp32":
            from commsched.runtime.compressed_ddp import CompressedDDP

            return CompressedDDP(cfg.comm_dtype, **ddp)
        return DDPStrategy(**ddp)
    profile = cfg.profile
    if profile.dir is None and out is not None:
        profile = dataclasses.replace(profile, dir=str(out / "profile"))
    return commsched.STRATEGIES[name](
        fusion=cfg.fusion,
        tuning=cfg.tuning,
        links=cfg.links,
        deft=cfg.deft,
        dear=cfg.dear,
        preserver=cfg.preserver,
        compression=cfg.compression,
        streams=cfg.streams,
        profile=profile,
        timeout=timeout,
        comm_dtype=cfg.comm_dtype,
        schedule_options=getattr(cfg, name) if name in own_nodes(bool(cfg.plugins)) else None,
    )


def check_plan_file(cfg: TrainConfig) -> None:
    """A plan file must be a plan, and one for this model: its parameter names are checked against the
    model built on the meta device (no memory, no weights), before any worker starts."""
    import torch

    from commsched.planning.plan_file import SavedPlan

    plan = SavedPlan.load(cfg.fusion.plan_file)
    with torch.device("meta"):
        model = build_model(cfg)
    plan.check_matches([name for name, _ in model.named_parameters()])
