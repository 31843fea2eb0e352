"""Typed configuration of `commsched-bench` (conf/bench.yaml) and its validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from commsched import options
from commsched.cli.config import train_schedule_names
from commsched.errors import bad_value
from commsched.plugins import import_plugins
from commsched.rates import parse_rate

DEFAULT_SCHEDULES = ("ddp", "wfbp", "dear")
EXCHANGES = ("topk", "hier")
TUNED = "name/Nmb"
"""An entry with fixed N MB buckets (`dear/2mb`): a tuned row, beside the defaults."""
"""wfbp with another exchange: "topk" MSTopK at density 0.01 ("topk@0.001": another density; two-level
on several nodes), "hier" the dense two-level all-reduce. `name:S` runs wfbp, dear or hier on S streams
(`name:auto`: searched with the Python API's defaults; the search's steps are left out of the timing).
`name-bf16` / `name-fp16`: gradients sent as 16-bit floats (`comm_dtype`; ``ddp-bf16``: DDP with torch's
compress hook)."""
USER_CALLBACKS = ("clock", "weights")
"""`schedule+callback` runs the schedule with a callback of a user's in the Trainer: "clock" reads a clock
after every step (touches nothing), "weights" reads a weight's norm after every step (touches it)."""
BENCH_MODEL_NAMES = ("small_cnn", "resnet18", "vgg11", "resnet50", "vgg16", "gpt2_tiny")  # built by bench/models.py


@dataclass
class LinkConfig:
    rate: str = "none"  # e.g. 1gbit, 200mbit; none: the unlimited loopback


@dataclass
class ClusterConfig:
    """Run inside an emulated cluster instead (commsched-cluster): `nodes` > 0 turns it on."""

    nodes: int = 0
    workers_per_node: int = 1
    rate: str = "1gbit"
    secondary_rate: Optional[str] = None
    flow_rate: Optional[str] = None


@dataclass
class BenchConfig:
    models: list[str] = field(default_factory=lambda: ["small_cnn"])
    schedules: list[str] = field(
        default_factory=lambda: list(DEFAULT_SCHEDULES)
    )  # ddp or registered; `name+clock` adds a callback
    plugins: list[str] = field(
        default_factory=list
    )  # modules imported first: the schedules they register can be benchmarked
    devices: int = 2
    accelerator: str = "cpu"  # gpu: each rank computes on a CUDA device (ranks sharing one talk over gloo)
    link: LinkConfig = field(default_factory=LinkConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    width: int = 64  # channels (images) or embedding size (gpt2_tiny); SmallCNN width 64: 3.06 M parameters
    batch_size: int = 32
    bucket_cap_mb: Optional[float] = (
        None  # None: every schedule at its defaults (ddp: Lightning's); set: fixed buckets for all
    )
    warmup: int = 3
    steps: int = 20
    rounds: int = 3  # the schedules run interleaved this many times; the best median counts
    preserver: bool = True  # deft: with the Preserver (False: the knapsack's plan as solved)
    max_staleness: int = 0  # deft: the Preserver's max_staleness
    timeout_s: int = 600
    operator_profile: bool = False  # each entry once more under torch.profiler: MODEL/operators/ENTRY.txt


def register_bench_config() -> None:
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


ACCELERATORS = ("cpu", "gpu")


def gpu_layout(spec: Any) -> Optional[str]:
    """How ranks on GPUs are laid out where Lightning's own placement will not do; None elsewhere (the
    CPU, or no more ranks than GPUs: Lightning's devices, over NCCL).

    "cluster": an emulated cluster's nodes all run on this machine and each numbers its devices from
    0, so its ranks share GPUs; "nodes": more ranks than GPUs, each rank then a node of its own on the
    loopback (Lightning gives one node's ranks a device each). Either way every entry, ddp too, talks
    over gloo through host memory: NCCL refuses two ranks on one device."""
    if spec.get("accelerator", "cpu") != "gpu":
        return None
    if spec["cluster"]["nodes"]:
        return "cluster"
    import torch

    return "nodes" if spec["devices"] > torch.cuda.device_count() else None


def _check_accelerator(cfg: Any) -> None:
    options.choice("accelerator", cfg.accelerator, ACCELERATORS)
    if cfg.accelerator != "gpu":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise bad_value("accelerator", cfg.accelerator, "cpu (this machine has no CUDA device)")
    if cfg.cluster.nodes and cfg.cluster.workers_per_node > gpus:
        raise bad_value(
            "cluster.workers_per_node", cfg.cluster.workers_per_node, f"at most {gpus} (the GPUs a node's ranks use)"
        )
    if not cfg.cluster.nodes and cfg.link.rate != "none":
        raise bad_value(
            "link.rate",
            cfg.link.rate,
            "none with accelerator=gpu: ranks on GPUs of one machine talk through GPU copies or host memory, "
            f"never through a limited loopback; for a slow link between them use cluster.nodes={cfg.devices} "
            f"cluster.rate={cfg.link.rate}",
        )


def validate_bench(cfg: Any) -> None:
    if not cfg.models:
        raise bad_value("models", list(cfg.models), f"a non-empty list of {', '.join(BENCH_MODEL_NAMES)}")
    for model in cfg.models:
        options.choice("models", model, tuple(BENCH_MODEL_NAMES))
    import_plugins(cfg.plugins)
    names = train_schedule_names(bool(cfg.plugins))
    if not cfg.schedules:
        raise bad_value("schedules", list(cfg.schedules), f"a non-empty list of {', '.join(names)}")
    for entry in cfg.schedules:
        name, _, callback = str(entry).partition("+")
        name, dash, wire = name.rpartition("-")
        if not (dash and wire in ("bf16", "fp16")):
            name = str(entry).partition("+")[0]
        name, slash, cap = name.partition("/")
        if slash:
            try:
                valid = float(cap.removesuffix("mb")) > 0
            except ValueError:
                valid = False
            if not valid:
                raise bad_value(
                    f"schedules ({entry})", entry, "name/Nmb with N > 0 (fixed N MB buckets), e.g. dear/2mb"
                )
        name, colon, streams = name.partition(":")
        if colon:
            if name not in options.STRIPING_SCHEDULES and name != "hier":
                raise bad_value(
                    f"schedules ({entry})",
                    entry,
                    "streams after : only for wfbp, dear and hier, e.g. wfbp:4, dear:auto",
                )
            options.streams_value(f"schedules ({entry})", int(streams) if streams.isdigit() else streams)
        name, at, density = name.partition("@")
        options.choice("schedules", name, (*names, *EXCHANGES))
        if at:
            if name != "topk":
                raise bad_value(f"schedules ({entry})", entry, "a density after @ only for topk, e.g. topk@0.001")
            try:
                valid = 0 < float(density) <= 1
            except ValueError:
                valid = False
            if not valid:
                raise bad_value(f"schedules ({entry})", entry, "topk@D with 0 < D <= 1")
        if callback:
            options.choice(f"schedules ({entry})", callback, USER_CALLBACKS)
    if cfg.cluster.nodes:
        from commsched.cluster.spec import ClusterSpec

        ClusterSpec(
            cfg.cluster.nodes,
            cfg.cluster.workers_per_node,
            cfg.cluster.rate,
            cfg.cluster.secondary_rate,
            cfg.cluster.flow_rate,
        ).check(lambda field: f"cluster.{field}")
        if cfg.cluster.nodes * cfg.cluster.workers_per_node < 2:
            raise bad_value("cluster.nodes", cfg.cluster.nodes, "a cluster of 2 workers or more")
    elif cfg.devices < 2:
        raise bad_value("devices", cfg.devices, "an integer >= 2")
    if cfg.link.rate != "none":
        try:
            parse_rate(cfg.link.rate)
        except Exception:
            raise bad_value("link.rate", cfg.link.rate, "none or a rate such as 1gbit, 200mbit") from None
    for name in ("width", "batch_size", "steps", "rounds", "timeout_s"):
        options.positive_int(name, cfg[name])
    if cfg.warmup < 1:
        raise bad_value("warmup", cfg.warmup, "an integer >= 1")
    if cfg.bucket_cap_mb is not None:
        options.positive_number("bucket_cap_mb", cfg.bucket_cap_mb)
    if "gpt2_tiny" in cfg.models and cfg.width % 2:
        raise bad_value("width", cfg.width, "an even number with gpt2_tiny (2 attention heads)")
    _check_accelerator(cfg)
