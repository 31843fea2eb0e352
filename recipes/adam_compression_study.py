"""Which sparse exchange suits Adam(W)? A single-process study of P simulated workers on the digits.

DGC's momentum correction assumes SGD: the sent updates add up to the optimizer's own momentum. Adam
divides each coordinate by a running root-mean-square that the sparse, delayed gradients would distort,
so the product runs AdamW on the averaged sparse gradient with error feedback (and the density warm-up).
The alternative named in the literature (1-bit Adam, Tang et al. 2021) freezes the variance after a
dense warm-up: Adam then becomes momentum SGD under a fixed diagonal preconditioner, and DGC's momentum
correction applies to the preconditioned gradient. This script trains the same small CNN four ways,
identical in data order, initial weights and learning rate, and prints held-out accuracy per seed:

  dense      AdamW on the mean of the workers' gradients (what ddp trains)
  ef         each worker's residual (error feedback), top-k of it sent, AdamW on the mean sent
  ef-warmup  as ef, density warmed up as the product's default does (1, 1/4, ... over a quarter of the run)
  frozen     dense AdamW over the whole warm-up span, then the variance frozen: each worker keeps a velocity
             u <- b1 u + (1 - b1) g / (sqrt(v) + eps), accumulates it into its residual, sends the top-k;
             the weights take lr times the mean sent (decoupled weight decay as AdamW's)

Workers are simulated (one process, gradients per shard of each batch; BatchNorm statistics from the
first shard's forward, as ddp's broadcast of rank 0's buffers gives); selection is per tensor, and
one-dimensional tensors are sent whole, as the product sends them.

  .venv/bin/python recipes/adam_compression_study.py --density 0.01 --epochs 3 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from commsched.compression.warmup import SparsityWarmup, auto_span
from commsched.data.digits import load_digits_tensors
from commsched.models.small_cnn import SmallCNNBackbone

VARIANTS = ("dense", "ef", "ef-warmup", "frozen")


def top_k(values: torch.Tensor, density: float) -> torch.Tensor:
    """The entries of largest magnitude, `density` of them (at least one), the rest zero; one-dimensional
    values (biases, normalisation weights) whole, as the product sends them."""
    if values.dim() <= 1:
        return values.clone()
    flat = values.flatten()
    k = max(1, int(math.ceil(flat.numel() * density)))
    if k >= flat.numel():
        return values.clone()
    kept = torch.zeros_like(flat)
    index = flat.abs().topk(k).indices
    kept[index] = flat[index]
    return kept.view_as(values)


def sparse_mean(
    residuals: list[list[torch.Tensor]], contributions: list[list[torch.Tensor]], density: float
) -> list[torch.Tensor]:
    """Each worker adds its contribution to its residual, sends the top-k of it and keeps the rest
    (error feedback); the mean over the workers of what was sent."""
    sent = []
    for mine, theirs in zip(residuals, contributions):
        out = []
        for r, c in zip(mine, theirs):
            r.add_(c)
            s = top_k(r, density)
            r.sub_(s)
            out.append(s)
        sent.append(out)
    return [torch.stack(s).mean(0) for s in zip(*sent)]


def worker_gradients(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, workers: int
) -> list[list[torch.Tensor]]:
    """Each worker's gradients on its shard; BatchNorm's running statistics end as the first shard left them."""
    grads, kept = [], None
    for rank, (x, y) in enumerate(zip(images.chunk(workers), labels.chunk(workers))):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        if rank == 0:
            kept = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    model.load_state_dict(kept, strict=False)
    return grads


def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(images).argmax(1) == labels).float().mean().item()
    model.train()
    return correct


def train(variant: str, seed: int, args: argparse.Namespace, data: tuple) -> float:
    train_x, train_y, val_x, val_y = data
    torch.manual_seed(seed)
    model = SmallCNNBackbone(width=args.width)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    beta1, beta2 = optimizer.defaults["betas"]
    eps = optimizer.defaults["eps"]
    global_batch = args.batch * args.workers
    steps_per_epoch = len(train_y) // global_batch
    total = steps_per_epoch * args.epochs
    warmup = SparsityWarmup(args.density, 0, lambda: auto_span(steps_per_epoch, total))
    residuals = [[torch.zeros_like(p) for p in params] for _ in range(args.workers)]
    velocities = None
    preconditioner = None
    order = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(args.epochs):
        shuffled = torch.randperm(len(train_y), generator=order)
        for b in range(steps_per_epoch):
            index = shuffled[b * global_batch : (b + 1) * global_batch]
            grads = worker_gradients(model, train_x[index], train_y[index], args.workers)
            density = warmup.density(step) if variant in ("ef-warmup", "frozen") else args.density
            dense_warmup = density >= 1 / args.workers  # the product exchanges such densities densely
            dense_phase = (
                variant == "dense"
                or (variant == "ef-warmup" and dense_warmup)
                or (variant == "frozen" and step < warmup.end and preconditioner is None)
            )
            if variant != "frozen" or dense_phase:
                mean = (
                    [torch.stack(g).mean(0) for g in zip(*grads)]
                    if dense_phase
                    else sparse_mean(residuals, grads, density)
                )
                for p, g in zip(params, mean):
                    p.grad = g
                optimizer.step()
            else:  # frozen: the variance stops here; the velocity carries Adam's first moment on
                if preconditioner is None:
                    t = optimizer.state[params[0]]["step"].item()
                    preconditioner = [
                        1.0 / ((optimizer.state[p]["exp_avg_sq"] / (1 - beta2**t)).sqrt() + eps) for p in params
                    ]
                    start = [optimizer.state[p]["exp_avg"] * c for p, c in zip(params, preconditioner)]
                    velocities = [[u.clone() for u in start] for _ in range(args.workers)]
                    frozen_step = t
                frozen_step += 1
                for mine, worker_grads in zip(velocities, grads):
                    for u, g, c in zip(mine, worker_grads, preconditioner):
                        u.mul_(beta1).add_(g * c, alpha=1 - beta1)
                lr = optimizer.param_groups[0]["lr"]
                with torch.no_grad():
                    for p, s in zip(params, sparse_mean(residuals, velocities, density)):
                        p.mul_(1 - lr * args.weight_decay)
                        p.sub_(s, alpha=lr / (1 - beta1**frozen_step))
            step += 1
    return accuracy(model, val_x, val_y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="per worker")
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    images, labels = load_digits_tensors(32)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_val = int(len(labels) * 0.2)
    data = (images[order[n_val:]], labels[order[n_val:]], images[order[:n_val]], labels[order[:n_val]])
    results = {}
    for variant in args.variants:
        results[variant] = [train(variant, seed, args, data) for seed in args.seeds]
        print(f"{variant:10s} " + " ".join(f"{a:.4f}" for a in results[variant]), flush=True)
    base = statistics.mean(results.get("dense", [float("nan")]))
    print(f"density {args.density}, {args.epochs} epochs, {len(args.seeds)} seeds, {args.workers} simulated workers:")
    for variant, accs in results.items():
        print(
            f"  {variant:10s} mean val_acc {statistics.mean(accs):.4f} "
            f"({(statistics.mean(accs) - base) * 100:+.1f} points vs dense)"
        )


if __name__ == "__main__":
    main()
