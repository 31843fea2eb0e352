"""A hand-written Fabric loop under each strategy, for test_fabric.py.

Usage: python run_fabric.py OUT_DIR CASE [CASE ...]

CASE: STRATEGY (ddp, wfbp, dear, deft, topk, dear-fp16, dear-bayes, deft-undelayed, ddp-compiled and
dear-compiled: the model given to `fabric.setup` compiled, which Fabric compiles around the strategy's
wrapper) trains STEPS optimizer steps; STRATEGY-first trains the first HALF of them and saves with `fabric.save`;
STRATEGY-resumed loads that checkpoint with `fabric.load` and trains the rest (a separate process: the
first run has ended).

The loop is what LitGPT-style scripts write: Hugging Face's GPT-2 (a tiny config, tied embeddings),
AdamW with a warm-up schedule stepped by the loop, two micro-batches per step under
`fabric.no_backward_sync`, `fabric.clip_gradients` by norm (by value under fp16's scaler), an
evaluation forward under `torch.no_grad` every third step. Every rank writes OUT_DIR/<case>.rank<r>.pt:
its weights, the clipping norms, losses and loss scales, and the schedule that ran each step.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import commsched

warnings.filterwarnings("ignore")
STEPS, HALF, MICRO = 16, 8, 2
TOPK = {"compression": commsched.CompressionOptions(method="topk", density=0.05, sparsity_warmup_steps=0)}


def strategy_for(name: str):
    """By name as users write it; two cases whose layouts or schedule change mid-run whatever the timings:
    a Bayesian search over bucket sizes (rebuilt every two steps) and DeFT handing its iterations to DeAR."""
    if name == "ddp":
        return "ddp"
    if name == "topk":
        return commsched.WFBPFabricStrategy(**TOPK)
    if name == "dear-bayes":
        search = commsched.TuningOptions(
            trials=4, warmup_steps=1, trial_steps=2, min_mb=0.01, max_mb=0.2, first_mb=0.02
        )
        return commsched.DeARFabricStrategy(fusion="bayes", tuning=search)
    if name == "deft-undelayed":
        return commsched.DeFTFabricStrategy(fusion="fixed", deft=commsched.DeFTOptions(fallback="when_undelayed"))
    return name.removesuffix("-fp16").removesuffix("-compiled")


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return GPT2LMHeadModel(config)


def tokens() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, 128, (STEPS * MICRO * 2 * 4, 16), generator=generator))


def run(out: Path, case: str) -> None:
    name, _, part = case.partition("-first") if "-first" in case else case.partition("-resumed")
    resumed = case.endswith("-resumed")
    precision = None
    if name.endswith("-fp16"):  # fp16's GradScaler on CPU (Lightning turns "16-mixed" into bf16 there)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22)
        precision = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy_for(name), plugins=precision and [precision])
    fabric.launch()
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    net, optimizer = fabric.setup(torch.compile(net) if name.endswith("-compiled") else net, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(tokens(), batch_size=4, shuffle=False))
    checkpoint = out / f"{name}.ckpt"
    start = 0
    if resumed:
        state = {"model": net, "optimizer": optimizer, "scheduler": warmup, "step": 0}
        fabric.load(checkpoint, state)
        start = state["step"]
    stop = HALF if case.endswith("-first") else STEPS
    batches = list(loader)
    norms, losses, scales, ran = [], [], [], []
    for step in range(start, stop):
        for micro in range(MICRO):
            (ids,) = batches[step * MICRO + micro]
            with fabric.no_backward_sync(net, enabled=micro < MICRO - 1):
                logits = net(ids).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1)) / MICRO
                fabric.backward(loss)
            losses.append(loss.item())
        if precision is None:
            norms.append(float(fabric.clip_gradients(net, optimizer, max_norm=0.5)))
        else:  # by value: elementwise, so fp16's amplified roundings do not hide a wrong order of unscale and clip
            fabric.clip_gradients(net, optimizer, clip_val=0.01)
        running = getattr(fabric.strategy, "schedule", None)
        ran.append((running.name, len(running.plan.buckets)) if running is not None else ("ddp", 0))
        optimizer.step()
        optimizer.zero_grad()
        if precision is not None:
            scales.append(precision.scaler.get_scale())
        warmup.step()
        if step % 3 == 2:
            with torch.no_grad():
                losses.append(net(batches[0][0]).logits.float().mean().item())
    if case.endswith("-first"):
        fabric.save(checkpoint, {"model": net, "optimizer": optimizer, "scheduler": warmup, "step": stop})
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    initial = model().state_dict()
    moved = max((state[k] - initial[k]).abs().max().item() for k in initial)
    result = {"state": state, "norms": norms, "losses": losses, "scales": scales, "ran": ran, "moved": moved}
    torch.save(result, out / f"{case}.rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for case in sys.argv[2:]:
        run(out_dir, case)
