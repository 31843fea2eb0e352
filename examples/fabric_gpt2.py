"""fabric_gpt2.py: a hand-written Lightning Fabric loop, trained with `strategy="dear"`.

The loop is the one LitGPT-style scripts write: Hugging Face's GPT-2 (a small config) on the bytes of a
text, AdamW with a warm-up schedule, gradient accumulation under `fabric.no_backward_sync`, clipping
with `fabric.clip_gradients`, and a checkpoint written with `fabric.save` that `--resume` continues
from. Importing commsched registers its strategies with Fabric as with the Trainer; the strategy's name
is the only change from a `ddp` script.

    python examples/fabric_gpt2.py                         # 2 CPU processes, 40 optimizer steps
    python examples/fabric_gpt2.py --strategy ddp          # the same run under Fabric's ddp
    python examples/fabric_gpt2.py --steps 10 --save gpt2.ckpt && \
        python examples/fabric_gpt2.py --steps 20 --resume gpt2.ckpt   # stop, then continue exactly
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import commsched  # noqa: F401  (registers "wfbp", "dear", "deft", "topk" with Fabric and the Trainer)

CONTEXT = 64


class Bytes(Dataset):
    """Windows of CONTEXT + 1 bytes of a text: the model predicts each next byte."""

    def __init__(self, text: bytes) -> None:
        self.data = torch.tensor(list(text), dtype=torch.long)

    def __len__(self) -> int:
        return (len(self.data) - 1) // CONTEXT

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * CONTEXT : (i + 1) * CONTEXT + 1]


def micro_batches(data: Bytes, step: int, fabric: Fabric, count: int, size: int = 8) -> list[torch.Tensor]:
    """This rank's share of step `step`'s shuffle, as a function of the step alone: a resumed run trains on
    what the uninterrupted run would have (a loader's iterator position is not in the checkpoint)."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(step))
    mine = order[fabric.global_rank :: fabric.world_size]
    windows = [torch.stack([data[int(i)] for i in mine[m * size : (m + 1) * size]]) for m in range(count)]
    return [fabric.to_device(w) for w in windows]


def text() -> bytes:
    """Real English to train on, shipped with every Python: the source of the standard library's `inspect`."""
    return inspect.getsource(inspect).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="dear")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps to train up to")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--save", type=Path, help="fabric.save the run here at the end")
    parser.add_argument("--resume", type=Path, help="fabric.load this checkpoint first")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy)
    fabric.launch()
    fabric.seed_everything(0)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # as nanoGPT pretrains: resumes exactly
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=128, n_layer=4, n_head=4, **no_dropout)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    model, optimizer = fabric.setup(model, optimizer)
    data = Bytes(text())

    state = {"model": model, "optimizer": optimizer, "scheduler": warmup, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    step = state["step"]
    while step < args.steps:
        for micro, window in enumerate(micro_batches(data, step, fabric, args.accumulate)):
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(window[:, :-1]).logits
                loss = F.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
                fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        warmup.step()
        step += 1
        if step % 10 == 0 or step == args.steps:
            fabric.print(f"step {step}: loss {loss.item():.4f}, gradient norm {norm.item():.3f}")
    state["step"] = step
    if args.save:
        fabric.save(args.save, state)
    total = sum(p.detach().double().sum().item() for p in model.parameters())
    fabric.print(f"{args.strategy}: loss {loss.item():.6f}, weight sum {total:.6f} after {step} steps")


if __name__ == "__main__":
    main()
