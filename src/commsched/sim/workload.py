"""What the simulator schedules: a model's layers in forward order with their gradient bytes and
forward/backward seconds, from a profile JSON (`commsched.profile`) or built in from the zoo.

The built-in tables count each layer's forward FLOPs with torch's `FlopCounterMode` on the meta
device (exact for the zoo's definitions, no compute) and turn them into seconds at an assumed
effective device speed; backward is taken as twice forward ([DeAR] §VI-B). FLOPs that belong to
no parameter-owning layer (attention products, residual adds) are spread over the layers in
proportion to their own FLOPs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from commsched.errors import bad_value

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Layer:
    name: str
    nbytes: int
    forward_s: float
    backward_s: float
    whole_nbytes: int = 0
    """Bytes of the layer's one-dimensional parameters (biases, norms), which a sparse exchange sends whole."""


@dataclass(frozen=True)
class Workload:
    name: str
    layers: tuple[Layer, ...]
    batch_size: int

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def sent_as(self, element_bytes: int) -> "Workload":
        """The same layers with their fp32 gradients sent as `element_bytes`-byte elements (`comm_dtype`)."""
        if element_bytes == 4:
            return self
        layers = tuple(
            Layer(l.name, l.nbytes * element_bytes // 4, l.forward_s, l.backward_s, l.whole_nbytes * element_bytes // 4)
            for l in self.layers
        )
        return Workload(self.name, layers, self.batch_size)

    def to_dict(self) -> dict:
        return {"name": self.name, "batch_size": self.batch_size, "layers": [asdict(layer) for layer in self.layers]}

    @classmethod
    def from_dict(cls, data: dict) -> "Workload":
        layers = tuple(
            Layer(
                l["name"],
                int(l["nbytes"]),
                float(l["forward_s"]),
                float(l["backward_s"]),
                int(l.get("whole_nbytes", 0)),
            )
            for l in data["layers"]
        )
        if not layers:
            raise ValueError("a workload needs at least one layer with parameters")
        return cls(str(data.get("name", "profile")), layers, int(data.get("batch_size", 0)))

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        """A profiler JSON (its "workload" entry) or a bare workload dict."""
        data = json.loads(Path(path).read_text())
        return cls.from_dict(data.get("workload", data))


def _zoo_model(name: str, batch_size: int) -> tuple["torch.nn.Module", "torch.Tensor"]:
    import torch

    from commsched.models import GPT2, VGG, GPT2Config, ResNet

    if name == "resnet50":
        return ResNet(50), torch.empty(batch_size, 3, 224, 224)
    if name == "vgg16":
        return VGG(16), torch.empty(batch_size, 3, 224, 224)
    if name == "gpt2":
        config = GPT2Config.small()
        return GPT2(config), torch.zeros(batch_size, config.block_size, dtype=torch.long)
    raise bad_value("workload", name, BUILTIN_WORKLOADS)


BUILTIN_WORKLOADS = ("resnet50", "vgg16", "gpt2")
DEFAULT_BATCH = {"resnet50": 64, "vgg16": 64, "gpt2": 8}


def builtin(name: str, batch_size: int | None = None, device_tflops: float = 10.0) -> Workload:
    """`device_tflops`: effective (not peak) FLOP/s of one worker, e.g. 10 for a V100 in fp32."""
    if name not in BUILTIN_WORKLOADS:
        raise bad_value("workload", name, BUILTIN_WORKLOADS)
    if device_tflops <= 0:
        raise bad_value("device_tflops", device_tflops, "a positive number")
    import torch  # the built-in workloads are counted on the meta device: torch only when asked for
    from torch.utils.flop_counter import FlopCounterMode

    batch_size = batch_size or DEFAULT_BATCH[name]
    with torch.device("meta"):
        model, inputs = _zoo_model(name, batch_size)
    owners = [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    order: list[str] = []
    hooks = [
        module.register_forward_pre_hook(lambda _m, _a, n=n: order.append(n) if n not in order else None)
        for n, module in owners
    ]
    counter = FlopCounterMode(display=False)
    with counter:
        model(inputs)
    for hook in hooks:
        hook.remove()
    counts = counter.get_flop_counts()
    prefix = type(model).__name__
    flops = {n: sum(counts.get(f"{prefix}.{n}", {}).values()) for n in order}
    total = sum(counts["Global"].values())
    owned = sum(flops.values()) or 1
    seen: set[int] = set()
    layers = []
    for n in order:
        module = dict(owners)[n]
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen and p.requires_grad]
        seen.update(id(p) for p in params)
        seconds = flops[n] * total / owned / (device_tflops * 1e12)
        layers.append(
            Layer(
                n,
                sum(p.numel() * p.element_size() for p in params),
                seconds,
                2 * seconds,
                sum(p.numel() * p.element_size() for p in params if p.dim() <= 1),
            )
        )
    return Workload(name, tuple(layers), batch_size)
