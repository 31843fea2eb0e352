"""A single-process reference for stale updates, written apart from the engine: SGD (momentum, weight
decay) on a BatchNorm network, each step applying the gradient computed `staleness` steps earlier
(0: synchronous). BatchNorm's running statistics follow the forwards, which run on the current
weights, as they do under DeFT's delayed plans.

Compensations of the delay, each written out here from its paper (`COMPENSATIONS`):
- "spike" (Kosson et al., Pipelined Backpropagation at Scale, 2021): a gradient D steps late missed
  the momentum contributions lr (1 + m + ... + m^(D-1)) it would have made by now: it is applied at once
  with that weight, a = (1 - m^D) / (1 - m), and joins the velocity scaled by b = m^D, so that its total
  contribution, lr / (1 - m), is the synchronous one;
- "nesterov": torch's Nesterov momentum on the stale gradient (what spike compensation nearly is at D = 1);
- "dc" (DC-ASGD, Zheng et al. 2017): g + lambda g * g * (w_now - w_then), lambda 0.04 (MXNet's default);
- "dc-adaptive": DC-ASGD-a, lambda_t = lambda_0 / sqrt(mean square of g), lambda_0 2, mean square an
  average of g^2 with factor 0.95;
- "predict" (linear weight prediction, after Kosson et al.): the forward and backward run on the
  weights extrapolated D steps along the last update, w + D (w_now - w_before), so that the gradient
  is taken where it will be applied; the update applies to the weights themselves;
- "spike+predict": both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def digits(
    resolution: int = 8, seed: int = 0, val_fraction: float = 0.2
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
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
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 4 * width, 3, padding=1, bias=False),
        nn.BatchNorm2d(4 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * width * 4, 10),
    )


@dataclass
class Run:
    accuracy: float
    losses: list[float] = field(default_factory=list)


def resnet18(width: int = 8) -> nn.Module:
    from commsched.models.resnet import ResNet

    return ResNet(18, num_classes=10, cifar_stem=True, width=width)


def vgg16_bn(width: int = 8) -> nn.Module:
    """VGG-16 with BatchNorm and the CIFAR-size head; five poolings: 32x32 inputs."""
    from commsched.models.vgg import VGG

    return VGG(16, num_classes=10, batch_norm=True, cifar_head=True, width=width, hidden=64)


MODELS = {"bn_net": bn_net, "resnet18": resnet18, "vgg16_bn": vgg16_bn}


COMPENSATIONS = ("none", "spike", "nesterov", "dc", "dc-adaptive", "predict", "spike+predict")


class StaleSGD:
    """SGD with momentum and weight decay (torch's update, written out) whose gradient is `staleness`
    steps late, with one of `COMPENSATIONS`."""

    def __init__(
        self,
        params: list[torch.Tensor],
        lr: float,
        momentum: float,
        weight_decay: float,
        staleness: int,
        compensation: str = "none",
        dc_lambda: float = 0.04,
        dc_lambda0: float = 2.0,
    ) -> None:
        if compensation not in COMPENSATIONS:
            raise ValueError(f"compensation: one of {COMPENSATIONS}, not {compensation!r}")
        self.params, self.lr, self.momentum, self.weight_decay = params, lr, momentum, weight_decay
        self.staleness, self.compensation = staleness, compensation
        self.dc_lambda, self.dc_lambda0 = dc_lambda, dc_lambda0
        self.velocity: list[Optional[torch.Tensor]] = [None] * len(params)
        self.mean_square = [torch.zeros_like(p) for p in params]
        self.last_update = [torch.zeros_like(p) for p in params]

    @property
    def predicts(self) -> bool:
        return self.compensation.endswith("predict")

    def predicted(self) -> list[torch.Tensor]:
        """The weights the forward should run on: the current ones, or extrapolated along the last update."""
        if not self.predicts:
            return [p.detach().clone() for p in self.params]
        return [p.detach() + self.staleness * u for p, u in zip(self.params, self.last_update)]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], weights_then: list[torch.Tensor]) -> None:
        m, late = self.momentum, self.staleness
        spike = self.compensation.startswith("spike") and late > 0 and m > 0
        a = (1 - m**late) / (1 - m) if spike else 0.0
        b = m**late if spike else 1.0
        for i, (p, g, then) in enumerate(zip(self.params, grads, weights_then)):
            if self.compensation == "dc":
                g = g + self.dc_lambda * g * g * (p - then)
            elif self.compensation == "dc-adaptive":
                self.mean_square[i].mul_(0.95).add_(g * g, alpha=0.05)
                g = g + self.dc_lambda0 / (self.mean_square[i].sqrt() + 1e-7) * g * g * (p - then)
            d = g + self.weight_decay * p
            before = p.clone()
            if m == 0:
                p.sub_(d, alpha=self.lr)
            else:
                v = self.velocity[i]
                v = (b * d).clone() if v is None else v.mul_(m).add_(d, alpha=b)
                self.velocity[i] = v
                if self.compensation == "nesterov":
                    p.sub_(d + m * v, alpha=self.lr)
                else:
                    p.sub_(v + a * d, alpha=self.lr)
            self.last_update[i] = p - before


class StaleAdamW:
    """torch's AdamW on gradients `staleness` steps late; compensations "none", "predict", and an Adam
    analogue of spike compensation ("spike", "spike+predict"): the late gradient gets at once the
    first-moment weight it missed, 1 - beta1^D, and the first moment keeps only (1 - beta1) beta1^D of
    it, so that its total weight is the synchronous one. The same interface as `StaleSGD`."""

    def __init__(
        self, params: list[torch.Tensor], lr: float, weight_decay: float, staleness: int, compensation: str = "none"
    ) -> None:
        if compensation not in ("none", "predict", "spike", "spike+predict"):
            raise ValueError(
                f"compensation under AdamW: 'none', 'predict', 'spike' or 'spike+predict', not {compensation!r}"
            )
        self.params, self.staleness, self.compensation = params, staleness, compensation
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.last_update = [torch.zeros_like(p) for p in params]

    def predicted(self) -> list[torch.Tensor]:
        if not self.compensation.endswith("predict"):
            return [p.detach().clone() for p in self.params]
        return [p.detach() + self.staleness * u for p, u in zip(self.params, self.last_update)]

    def step(self, grads: list[torch.Tensor], weights_then: list[torch.Tensor]) -> None:
        before = [p.detach().clone() for p in self.params]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimizer.step()
        if self.compensation.startswith("spike") and self.staleness > 0:
            self._spike(grads)
        self.last_update = [p.detach() - b for p, b in zip(self.params, before)]

    @torch.no_grad()
    def _spike(self, grads: list[torch.Tensor]) -> None:
        """After torch's step (numerator beta1 m + (1 - beta1) g): the numerator gets beta1 (1 - beta1^D) g
        more, and the first moment (1 - beta1)(1 - beta1^D) g less."""
        group = self.optimizer.param_groups[0]
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        missed = 1 - beta1**self.staleness
        for p, g in zip(self.params, grads):
            state = self.optimizer.state[p]
            step = float(state["step"])
            state["exp_avg"].add_(g, alpha=-(1 - beta1) * missed)
            denominator = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(eps)
            p.addcdiv_(g, denominator, value=-lr * beta1 * missed / (1 - beta1**step))


def stale_iteration(params: list[torch.Tensor], optimizer, late: deque, run: Run, loss_at) -> None:
    """One iteration: forward and backward on the weights the optimizer predicts (the current ones unless
    it predicts), the weights put back, the gradient queued, and the oldest queued one stepped once it is
    `optimizer.staleness` iterations old."""
    weights = [p.detach().clone() for p in params]
    forward_at = optimizer.predicted()
    with torch.no_grad():
        for p, w in zip(params, forward_at):
            p.copy_(w)
    loss = loss_at()
    for p in params:
        p.grad = None
    loss.backward()
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    run.losses.append(float(loss.detach()))
    late.append(([p.grad.detach().clone() for p in params], forward_at))
    if len(late) > optimizer.staleness:
        optimizer.step(*late.popleft())


@dataclass
class LossGuard:
    """A guard on a stale run (measured by recipes/staleness_guard.py, not in the product): after
    `window` stale iterations, if their mean training loss did not fall below that of the `window`
    synchronous iterations before, the rest of training is synchronous; with `rollback`, from the
    weights, BatchNorm buffers and velocity of the switch (what the stale iterations did is dropped)."""

    window: int = 10
    rollback: bool = False
    windows: int = 1
    """How many consecutive windows are judged, each against the one before it (the first against the
    synchronous window); a stop at any of them rolls back to the plan's start."""
    rule: str = "mean"
    """"mean": stop unless the stale window's mean loss is below the synchronous window's; "trend": below
    the synchronous window's least-squares line carried on over the stale window (early in training,
    where the loss falls fast whatever runs, "mean" is too easy to pass)."""
    verdict: str = "not reached"
    stopped: bool = False
    snapshot: Optional[tuple] = None

    def at(
        self, iteration: int, stale_from: int, model: nn.Module, optimizer: "StaleSGD", late: deque, run: Run
    ) -> None:
        if self.rollback and iteration == stale_from + 1:
            self.snapshot = (
                {k: v.clone() for k, v in model.state_dict().items()},
                [None if v is None else v.clone() for v in optimizer.velocity],
                [u.clone() for u in optimizer.last_update],
            )
        judged, due = divmod(iteration - stale_from - 1, self.window)
        if due or not 1 <= judged <= self.windows or self.stopped:
            return
        previous = run.losses[stale_from + (judged - 2) * self.window : stale_from + (judged - 1) * self.window]
        before = sum(previous) / self.window if self.rule == "mean" or judged > 1 else trend_forecast(previous)
        after = (
            sum(run.losses[stale_from + (judged - 1) * self.window : stale_from + judged * self.window]) / self.window
        )
        self.stopped = after >= before
        self.verdict = (
            f"{self.verdict}, " if judged > 1 else ""
        ) + f"{'stopped' if self.stopped else 'kept'} ({before:.2f} -> {after:.2f})"
        if not self.stopped:
            return
        if self.snapshot is not None:
            late.clear()
            model.load_state_dict(self.snapshot[0])
            optimizer.velocity, optimizer.last_update = self.snapshot[1], self.snapshot[2]
        while late:  # what is in flight is applied, then every step is synchronous
            optimizer.step(*late.popleft())


def trend_forecast(losses: list[float]) -> float:
    """The mean over the next len(losses) iterations of the least-squares line through `losses`."""
    n = len(losses)
    x_mean, y_mean = (n - 1) / 2, sum(losses) / n
    slope = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(losses)) / sum((x - x_mean) ** 2 for x in range(n))
    return y_mean + slope * n  # the line at the next window's centre, n steps after this one's


def train(
    lr: float,
    momentum: float,
    staleness: int,
    epochs: int,
    seed: int,
    weight_decay: float = 5e-4,
    batch_size: int = 64,
    width: int = 16,
    model_name: str = "bn_net",
    resolution: int = 8,
    compensation: str = "none",
    optimizer_name: str = "sgd",
    stale_from: int = 0,
    guard: Optional[LossGuard] = None,
) -> Run:
    """Held-out accuracy after `epochs` of SGD whose every step applies the gradient of `staleness` steps
    ago, compensated as `compensation` says (one of `COMPENSATIONS`). The first `stale_from` iterations
    step synchronously (as DeFT's warm-up and measured steps do); the iteration after them steps nothing,
    and from then on each step applies the gradient of `staleness` iterations before."""
    torch.manual_seed(seed)
    (x, y), (x_val, y_val) = digits(resolution)
    model = MODELS[model_name](width)
    params = list(model.parameters())
    optimizer = (
        StaleAdamW(params, lr, weight_decay, staleness, compensation)
        if optimizer_name == "adamw"
        else StaleSGD(params, lr, momentum, weight_decay, staleness, compensation)
    )
    late: deque[tuple[list[torch.Tensor], list[torch.Tensor]]] = deque()
    run = Run(0.0)
    iteration = 0
    shuffle = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=shuffle)
        for start in range(0, len(y) - batch_size + 1, batch_size):
            batch = order[start : start + batch_size]
            model.train()
            iteration += 1
            if guard is not None and staleness:
                guard.at(iteration, stale_from, model, optimizer, late, run)
            stale = guard is None or not guard.stopped
            optimizer.staleness = staleness if stale and iteration > stale_from else 0
            stale_iteration(params, optimizer, late, run, lambda: F.cross_entropy(model(x[batch]), y[batch]))
    model.eval()
    with torch.no_grad():
        run.accuracy = float((model(x_val).argmax(1) == y_val).float().mean())
    return run


def after_steps(
    lr: float,
    momentum: float,
    steps: int,
    seed: int,
    batch_size: int = 64,
    width: int = 16,
    weight_decay: float = 5e-4,
    model_name: str = "bn_net",
    resolution: int = 8,
):
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


def train_text(
    lr: float,
    staleness: int,
    steps: int,
    seed: int,
    weight_decay: float = 0.01,
    batch_size: int = 16,
    compensation: str = "none",
    stale_from: int = 0,
    eval_batches: int = 8,
) -> Run:
    """GPT-2 tiny (`commsched.models.gpt2`) on the bytes of Python's documentation topics, trained by
    `StaleAdamW` for `steps` steps whose gradients are `staleness` iterations late after the first
    `stale_from`; `Run.accuracy` holds the held-out loss (lower is better) over `eval_batches` fixed
    windows of the last tenth of the text."""
    from commsched.data.text import read_bytes
    from commsched.models.gpt2 import GPT2, GPT2Config

    torch.manual_seed(seed)
    config = GPT2Config.tiny()
    tokens = read_bytes(None)
    cut = int(len(tokens) * 0.9)
    train_tokens, val_tokens = tokens[:cut], tokens[cut:]
    model = GPT2(config)
    params = list(model.parameters())
    optimizer = StaleAdamW(params, lr, weight_decay, staleness, compensation)
    window = config.block_size + 1
    draw = torch.Generator().manual_seed(seed)
    late: deque[tuple[list[torch.Tensor], list[torch.Tensor]]] = deque()
    run = Run(0.0)

    def loss_of(chunk: torch.Tensor) -> torch.Tensor:
        logits = model(chunk[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1))

    for iteration in range(1, steps + 1):
        optimizer.staleness = staleness if iteration > stale_from else 0
        starts = torch.randint(0, len(train_tokens) - window, (batch_size,), generator=draw)
        chunk = torch.stack([train_tokens[s : s + window] for s in starts.tolist()])
        stale_iteration(params, optimizer, late, run, lambda: loss_of(chunk))
    with torch.no_grad():
        starts = torch.linspace(0, len(val_tokens) - window - 1, eval_batches * batch_size).long()
        held_out = torch.stack([val_tokens[s : s + window] for s in starts.tolist()])
        run.accuracy = float(sum(loss_of(part) for part in held_out.split(batch_size)) / eval_batches)
    return run
