"""A single-process reference for stale updates, written apart from the engine: plain PyTorch SGD
(momentum, weight decay) on a BatchNorm network, each step applying the gradient computed
`staleness` steps earlier (0: synchronous). BatchNorm's running statistics follow the forwards,
which run on the current weights, as they do under DeFT's delayed plans."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def digits(resolution: int = 8, seed: int = 0, val_fraction: float = 0.2) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's digits (8x8, resized to `resolution`), three channels, split with a fixed seed."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if resolution != 8:
        images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False)
    images = ((images - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * val_fraction)
    return (images[order[n_val:]], labels[order[n_val:]]), (images[order[:n_val]], labels[order[:n_val]])


def bn_net(width: int = 16) -> nn.Module:
    """Three conv-BatchNorm-ReLU blocks and a linear head: small enough for a test, deep enough to sharpen."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 4 * width, 3, padding=1, bias=False), nn.BatchNorm2d(4 * width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * width * 4, 10),
    )


@dataclass
class Run:
    accuracy: float
    losses: list[float] = field(default_factory=list)


def resnet18(width: int = 8) -> nn.Module:
    from commsched.models.resnet import ResNet

    return ResNet(18, num_classes=10, cifar_stem=True, width=width)


MODELS = {"bn_net": bn_net, "resnet18": resnet18}


def train(lr: float, momentum: float, staleness: int, epochs: int, seed: int, weight_decay: float = 5e-4,
          batch_size: int = 64, width: int = 16, model_name: str = "bn_net", resolution: int = 8) -> Run:
    """Held-out accuracy after `epochs` of SGD whose every step applies the gradient of `staleness` steps ago."""
    torch.manual_seed(seed)
    (x, y), (x_val, y_val) = digits(resolution)
    model = MODELS[model_name](width)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    late: deque[list[torch.Tensor]] = deque()
    run = Run(0.0)
    shuffle = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=shuffle)
        for start in range(0, len(y) - batch_size + 1, batch_size):
            batch = order[start : start + batch_size]
            model.train()
            loss = F.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            run.losses.append(float(loss.detach()))
            late.append([p.grad.detach().clone() for p in model.parameters()])
            if len(late) > staleness:
                for p, g in zip(model.parameters(), late.popleft()):
                    p.grad = g
                optimizer.step()
    model.eval()
    with torch.no_grad():
        run.accuracy = float((model(x_val).argmax(1) == y_val).float().mean())
    return run


def after_steps(lr: float, momentum: float, steps: int, seed: int, batch_size: int = 64, width: int = 16,
                weight_decay: float = 5e-4, model_name: str = "bn_net", resolution: int = 8):
    """(model, optimizer, loss of the next batch) after `steps` synchronous steps: what the Preserver
    sees on DeFT's probe steps."""
    torch.manual_seed(seed)
    (x, y), _ = digits(resolution)
    model = MODELS[model_name](width)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    for step in range(steps + 1):
        start = (step * batch_size) % (len(y) - batch_size)
        batch = order[start : start + batch_size]
        loss = F.cross_entropy(model(x[batch]), y[batch])
        if step == steps:
            return model, optimizer, loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    raise AssertionError("unreachable")
