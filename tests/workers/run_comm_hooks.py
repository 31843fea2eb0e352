"""DDP's communication hooks under commsched's wfbp and under Lightning's DDPStrategy, for test_comm_hooks.py.

Usage: python run_comm_hooks.py OUT_DIR DEVICES CASE [CASE ...]

CASE: STRATEGY-HOOK[-PART]. STRATEGY: ddp (Lightning's DDPStrategy with the hook registered on CPU too:
Lightning registers hooks on CUDA only, torch's DDP runs them over gloo as well) or wfbp (commsched's
WFBPStrategy, the same arguments). HOOK: powersgd (torch's powerSGD_hook, rank 1, error feedback, warm
start, PowerSGD from step 3), powersgd16 (the same under fp16_compress_wrapper: the hook reads and writes
the wrapper's fp16 copy), batched (batched_powerSGD_hook, the same state), fp16wrap (allreduce_hook under
fp16_compress_wrapper); a "4k" suffix: buckets of 4 KB, several per model. PART: "first" trains one epoch
of HALF steps, saved by ModelCheckpoint; "resumed" resumes its last.ckpt and trains the rest; "resharded"
the same at another world size; none: all STEPS. Every rank writes OUT_DIR/<case>.rank<r>.pt: its weights,
the bucket layouts the hook was handed (parameter shapes per bucket) and the order of hook calls and of the
first layer's gradient in the last step.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.utils.data import DataLoader, TensorDataset

import commsched

warnings.filterwarnings("ignore")
STEPS, HALF = 20, 10


class HookedDDP(DDPStrategy):
    """Lightning's DDPStrategy with its hook (and wrapper) registered on CPU as on CUDA."""

    def _register_ddp_hooks(self) -> None:
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(self._ddp_comm_state, one_bucket_at_a_time(hook))


def one_bucket_at_a_time(hook):
    """DDP runs each bucket's hook as the bucket fills; PowerSGD's later collectives start from the first's
    completion on gloo's threads, so two buckets' interleave differently on each rank and gloo fails. The
    reference waits for a bucket's hook before the next one starts (the math is the hook's, unchanged)."""
    last = []

    def serial(state, bucket):
        if last:
            last.pop().wait()
        future = hook(state, bucket)
        last.append(future)
        return future

    return serial


EVENTS: list[str] = []
"""This step's order of hook calls and of the first layer's gradient (whether hooks run during backward)."""


def recording(hook, layouts: dict):
    """The hook, noting the shapes of the parameters of each bucket it is handed, and when it was called."""

    def recorded(state, bucket):
        layouts[bucket.index()] = [tuple(p.shape) for p in bucket.parameters()]
        EVENTS.append(f"hook {bucket.index()}")
        return hook(state, bucket)

    return recorded


def hook_arguments(name: str, layouts: dict) -> dict:
    if name == "fp16wrap":
        return {
            "ddp_comm_hook": recording(default_hooks.allreduce_hook, layouts),
            "ddp_comm_wrapper": default_hooks.fp16_compress_wrapper,
        }
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3, random_seed=7
    )
    hook = powerSGD_hook.batched_powerSGD_hook if name == "batched" else powerSGD_hook.powerSGD_hook
    wrapper = {"ddp_comm_wrapper": default_hooks.fp16_compress_wrapper} if name == "powersgd16" else {}
    return {"ddp_comm_hook": recording(hook, layouts), "ddp_comm_state": state, **wrapper}


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4))
        self.net[0].weight.register_hook(lambda grad: EVENTS.append("first layer's gradient"))

    def training_step(self, batch, batch_idx):
        EVENTS.clear()
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def run(out: Path, devices: int, case: str) -> None:
    kind, hook, *part = case.split("-")
    layouts: dict = {}
    arguments = hook_arguments(hook.removesuffix("4k"), layouts)
    if hook.endswith("4k"):  # several buckets, the same 4 KB cap under both (DDP then drops its 1 MB first bucket)
        arguments["bucket_cap_mb"] = 4096 / 2**20
    strategy = HookedDDP(**arguments) if kind == "ddp" else commsched.WFBPStrategy(**arguments)
    part = part[0] if part else None
    folder = out / f"{kind}-{hook}-ckpt" if part else out / f"{case}-unused"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1 if part == "first" else STEPS // HALF,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
    )
    torch.manual_seed(0)
    model = Net()
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(HALF * 16, 24, generator=generator), torch.randint(0, 4, (HALF * 16,)))
    loader = DataLoader(data, batch_size=16 // devices if devices > 1 else 8)
    resume = folder / "last.ckpt" if part in ("resumed", "resharded") else None
    trainer.fit(model, loader, ckpt_path=resume)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = {"state": state, "layouts": layouts, "steps": trainer.global_step, "events": list(EVENTS)}
    torch.save(result, out / f"{case}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out_dir, world = Path(sys.argv[1]), int(sys.argv[2])
    for name in sys.argv[3:]:
        run(out_dir, world, name)
