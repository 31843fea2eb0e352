"""Typed configuration of a training run (Hydra structured configs) and its validation.

Every field a user can set on the command line is declared here with its type. Hydra's
configuration is converted once (`train_config`) into a `TrainConfig` whose concerns are the
options dataclasses themselves; `validate` checks them in place, with the values that types cannot
(choices, ranges, model/data compatibility), in the launching process, so a typo fails before any
worker starts, with the valid choices in the message; the builders hand the same objects to the
strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from commsched import options
from commsched.errors import CommSchedConfigError, bad_value
from commsched.model_names import GPT2_SIZES, IMAGE_ARCHS
from commsched.options import (
    CompressionOptions,
    DeAROptions,
    DeFTOptions,
    FusionOptions,
    LinkOptions,
    PreserverOptions,
    ProfileOptions,
    StreamOptions,
    TuningOptions,
)

REFERENCE = "ddp"  # Lightning's own DistributedDataParallel, the reference every schedule is compared with


def train_schedule_names(plugins_loaded: bool) -> tuple[str, ...]:
    """ddp (Lightning's DDP, the reference) and every registered schedule: the built-in ones without
    importing torch when no plugin was loaded, else `commsched.SCHEDULES`."""
    from commsched.options import BUILTIN_SCHEDULES

    if not plugins_loaded:
        return ("ddp", *BUILTIN_SCHEDULES)
    from commsched.schedules import SCHEDULES

    return ("ddp", *SCHEDULES)


@dataclass
class ScheduleConfig:
    name: str = "dear"
    """ddp (Lightning's DDP) or a registered schedule: wfbp, dear, deft and whatever `plugins` register."""


@dataclass
class ModelConfig:
    kind: str = "image"  # image | language
    arch: str = "resnet18"  # image: one of IMAGE_ARCHS
    num_classes: int = 10
    cifar: bool = True
    width: int = 64
    size: str = "tiny"  # language: tiny | small
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    optimizer: str = "sgd"
    lr: float = 0.1
    weight_decay: float = 5e-4
    momentum: float = 0.9
    lr_schedule: str = "constant"


@dataclass
class DataConfig:
    name: str = "synthetic_images"  # synthetic_images | synthetic_tokens | cifar10 | digits | text
    batch_size: int = 32
    train_size: int = 2048
    val_size: int = 256
    resolution: int = 32
    block_size: int = 64
    dir: str = "~/data/cifar-10-batches-py"
    path: Optional[str] = None
    num_workers: int = 0
    seed: int = 0


@dataclass
class TrainerConfig:
    accelerator: str = "cpu"
    devices: int = 2
    num_nodes: int = 1
    max_steps: int = 50
    max_epochs: Optional[int] = None
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    val_check_interval: Optional[float] = None
    limit_val_batches: Optional[float] = None
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    timeout_s: int = 1800


@dataclass
class CheckpointConfig:
    """Lightning checkpoints of the run, in <run dir>/checkpoints (communication state included)."""

    enabled: bool = True
    every_n_steps: int = 0  # 0: at the end of every epoch (and when the run stops)
    save_last: bool = True  # checkpoints/last.ckpt: what resume=<run dir> continues from
    monitor: Optional[str] = None  # e.g. val_loss: also keep the best top_k by it
    mode: str = "min"
    top_k: int = 1


@dataclass
class TrainConfig:
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    fusion: FusionOptions = field(default_factory=FusionOptions)
    tuning: TuningOptions = field(default_factory=TuningOptions)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    profile: ProfileOptions = field(default_factory=ProfileOptions)
    links: LinkOptions = field(default_factory=LinkOptions)
    deft: DeFTOptions = field(default_factory=DeFTOptions)
    dear: DeAROptions = field(default_factory=DeAROptions)
    preserver: PreserverOptions = field(default_factory=PreserverOptions)
    compression: CompressionOptions = field(default_factory=CompressionOptions)
    streams: StreamOptions = field(default_factory=StreamOptions)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    comm_dtype: str = "fp32"  # what gradients travel as: fp32, or bf16 / fp16 (half the bytes; ddp: its compress hook)
    resume: Optional[str] = None  # a checkpoint file, or a previous run directory (its checkpoints/last.ckpt)
    plugins: list[str] = field(
        default_factory=list
    )  # modules imported first (and by every worker): the schedules they register
    seed: int = 0
    warmup_steps: int = 5  # steps left out of the samples/s summary


DATA_KIND = {
    "synthetic_images": "image",
    "cifar10": "image",
    "digits": "image",
    "synthetic_tokens": "language",
    "text": "language",
}


def own_nodes(plugins_loaded: bool) -> dict[str, type]:
    """The node of each plugin schedule's own options (`Schedule.options_class`), by schedule name: a
    schedule whose options class already has a node (dear's, deft's, for their subclasses) gets none."""
    if not plugins_loaded:
        return {}
    from commsched.schedules import SCHEDULES

    nodes = {
        name: cls.options_class
        for name, cls in SCHEDULES.items()
        if cls.options_class is not None and cls.options_class not in (DeAROptions, DeFTOptions)
    }
    for name in nodes:
        if name in TrainConfig.__dataclass_fields__:
            raise CommSchedConfigError(
                f"commsched: schedule {name!r} (registered by a plugin) has options of its own, "
                f"and its name is a node of the configuration already ({', '.join(TrainConfig.__dataclass_fields__)}): "
                "rename the schedule"
            )
    return nodes


def train_schema(plugins_loaded: bool) -> type[TrainConfig]:
    """`TrainConfig`, with one node more per plugin schedule that declares options of its own, named after it."""
    nodes = own_nodes(plugins_loaded)
    if not nodes:
        return TrainConfig
    key = tuple(sorted((name, cls) for name, cls in nodes.items()))
    if key not in _SCHEMAS:
        _SCHEMAS[key] = make_dataclass(
            "TrainConfig", [(name, cls, field(default_factory=cls)) for name, cls in key], bases=(TrainConfig,)
        )
    return _SCHEMAS[key]


_SCHEMAS: dict[tuple, type[TrainConfig]] = {}


def register_configs(
    schedules: Sequence[str] = (REFERENCE, *options.BUILTIN_SCHEDULES), schema: type[TrainConfig] = TrainConfig
) -> None:
    """Schemas for conf/train.yaml and its groups (Hydra then type-checks every override), and one
    `schedule=` choice per registered schedule."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=schema)
    for group, node in (
        ("fusion", FusionOptions),
        ("model", ModelConfig),
        ("data", DataConfig),
        ("trainer", TrainerConfig),
        ("links", LinkOptions),
        ("compression", CompressionOptions),
    ):
        store.store(group=group, name=f"{group}_schema", node=node)
    for name in schedules:
        store.store(group="schedule", name=name, node=ScheduleConfig(name=name))


def train_config(cfg: DictConfig) -> TrainConfig:
    """Hydra's configuration converted once into the typed `TrainConfig` that `validate`, the builders
    and the run read: its concerns are the options dataclasses the strategy receives as they are. `cfg`
    is `commsched-train`'s composition (typed by the schema it is composed on) or the resolved YAML a
    rank loads back (`commsched.cli.run`), typed against the schema here; `Any` fields keep their values."""
    typed_as = OmegaConf.get_type(cfg)
    if not (isinstance(typed_as, type) and issubclass(typed_as, TrainConfig)):
        cfg = OmegaConf.merge(OmegaConf.structured(train_schema(bool(cfg.get("plugins")))), cfg)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def validate(cfg: TrainConfig) -> None:
    """Raise CommSchedConfigError naming the field and the allowed values for anything unusable."""
    options.check_concerns(cfg)
    options.choice("comm_dtype", cfg.comm_dtype, options.COMM_DTYPES)
    options.choice("schedule.name", str(cfg.schedule.name), train_schedule_names(bool(cfg.plugins)))
    for node in own_nodes(bool(cfg.plugins)):  # every plugin schedule's, as dear.* and deft.* are always checked
        options.validated(getattr(cfg, node), f"{node}.")
    name = str(cfg.schedule.name)
    if name in options.BUILTIN_SCHEDULES:  # checked before torch is imported
        options.check_schedule_takes(
            cfg, name, name in options.COMPRESSING_SCHEDULES, name in options.STRIPING_SCHEDULES
        )
    elif name != "ddp":  # a plugin's schedule: the plugin imported the registry already
        from commsched.runtime.registry import SCHEDULES

        options.check_schedule_takes(cfg, name, SCHEDULES[name].compresses, SCHEDULES[name].stripes)
    elif cfg.streams.count != 1:
        raise bad_value(
            "streams.count",
            cfg.streams.count,
            "1 with schedule=ddp (Lightning's DDP has one communicator); "
            "schedule=wfbp runs the same schedule on several streams",
        )
    elif cfg.compression.method != "none" or cfg.compression.hierarchical:
        raise bad_value(
            "compression.method",
            cfg.compression.method,
            "none with schedule=ddp (Lightning's DDP all-reduces "
            "dense gradients); schedule=wfbp runs the same schedule with sparse exchanges",
        )
    if str(cfg.schedule.name) == "ddp" and (
        cfg.fusion.policy not in ("auto", "fixed") or cfg.fusion.plan_file is not None
    ):
        raise bad_value(
            "fusion", cfg.fusion.policy, "auto or fixed with schedule=ddp (Lightning's DDP takes only bucket_cap_mb)"
        )
    options.choice("model.kind", cfg.model.kind, ("image", "language"))
    if cfg.model.kind == "image":
        options.choice("model.arch", cfg.model.arch, IMAGE_ARCHS)
    else:
        options.choice("model.size", cfg.model.size, GPT2_SIZES)
    options.choice("model.optimizer", cfg.model.optimizer, ("sgd", "adamw"))
    options.choice("model.lr_schedule", cfg.model.lr_schedule, ("constant", "cosine"))
    options.positive_number("model.lr", cfg.model.lr)
    options.choice("data.name", cfg.data.name, tuple(DATA_KIND))
    if DATA_KIND[cfg.data.name] != cfg.model.kind:
        kinds = [name for name, kind in DATA_KIND.items() if kind == cfg.model.kind]
        raise bad_value("data", cfg.data.name, f"for a {cfg.model.kind} model one of {kinds}")
    options.positive_int("data.batch_size", cfg.data.batch_size)
    if cfg.trainer.devices != -1:
        options.positive_int("trainer.devices", cfg.trainer.devices)
    if cfg.trainer.max_steps != -1:
        options.positive_int("trainer.max_steps", cfg.trainer.max_steps)
    if cfg.profile.steps and str(cfg.schedule.name) == "ddp":
        raise bad_value(
            "profile.steps",
            cfg.profile.steps,
            "0 with schedule=ddp (Lightning's own DDP is not instrumented); "
            "profile schedule=wfbp, which runs the same communication",
        )
    options.non_negative_int("checkpoint.every_n_steps", cfg.checkpoint.every_n_steps)
    options.choice("checkpoint.mode", cfg.checkpoint.mode, ("min", "max"))
    options.non_negative_int("checkpoint.top_k", cfg.checkpoint.top_k)
    if cfg.resume is not None:
        resume_path(cfg.resume)
    if cfg.preserver.enabled:
        options.validated(cfg.preserver, "preserver.")
    if cfg.deft.timings_file is not None and not Path(cfg.deft.timings_file).expanduser().is_file():
        raise bad_value(
            "deft.timings_file", cfg.deft.timings_file, "an existing JSON file of per-bucket times (not found)"
        )
    if cfg.data.name == "text" and cfg.data.path is not None and not Path(cfg.data.path).expanduser().exists():
        raise bad_value("data.path", cfg.data.path, "an existing text file or directory (not found)")
    if cfg.data.name == "cifar10":
        from commsched.data import check_cifar10_dir

        check_cifar10_dir(cfg.data.dir)


def resume_path(resume: str) -> Path:
    """`resume=`: a checkpoint file, or a run directory whose checkpoints/last.ckpt is continued."""
    path = Path(resume).expanduser()
    if path.is_dir():
        last = path / "checkpoints" / "last.ckpt"
        if not last.is_file():
            raise bad_value(
                "resume", resume, f"a checkpoint file or a run directory with checkpoints/last.ckpt ({last} not found)"
            )
        return last
    if not path.is_file():
        raise bad_value("resume", resume, "a checkpoint file or a previous run directory (not found)")
    return path
