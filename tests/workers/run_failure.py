"""Start a 2-process run that must fail with a clear error; the test reads the exit code and output.

Usage: python run_failure.py MODE OUT_DIR   (MODE: lbfgs, plan-mismatch, peer-dies, peer-hangs,
peer-dies-saved: with Lightning's OnExceptionCheckpoint saving into OUT_DIR, the run's folder;
gather-dies, gather-dies-no-rollback: a `Chain` under DeAR whose rank 1 dies between two of step 3's
all-gathers, so that rank 0 has applied part of that step when the failure reaches it, saved by
OnExceptionCheckpoint; chain-reference: the same `Chain` under Lightning's ddp for 4 steps, saved after 3
as OUT_DIR/reference.ckpt and after 4 as OUT_DIR/after-forward-4.ckpt)
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

import commsched

sys.path.insert(0, str(Path(__file__).parent))
from exit_report import report_issuer_threads, watch_workers_slowly  # noqa: E402
from toy import ToyNet  # noqa: E402


class DiesAtStep3(ToyNet):
    """Rank 1 leaves at step 3: killed outright ('dies') or stuck forever ('hangs')."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            if self.how == "dies":
                os._exit(17)
            time.sleep(3600)


class Chain(pl.LightningModule):
    """Three linear layers, one bucket each, nothing touched before the first layer runs: DeAR's next
    forward applies the buckets one by one, as each layer is about to run. A BatchNorm without
    parameters after the first layer updates its statistics in that forward, before the second
    layer's bucket is needed."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(8, 32, bias=False),
            torch.nn.BatchNorm1d(32, affine=False),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 32, bias=False),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 4, bias=False),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


class DiesBetweenGathers(pl.Callback):
    """On rank 1: counts the gradient all-gathers (one per bucket per step) and dies as step 3's second
    one is launched, after taking part in the first."""

    def __init__(self) -> None:
        self.calls, self.per_step = 0, 0
        real = commsched.comm.point_to_point.all_gather

        def counted(group, full, shard):
            if full.is_floating_point():
                self.calls += 1
                if self.per_step and self.calls == 3 * self.per_step + 2:
                    self.last.wait()  # the first all-gather's sends have left
                    time.sleep(1.0)  # and arrived: on a busy machine the receiver may lag behind the socket
                    os._exit(17)
                self.last = real(group, full, shard)
                return self.last
            return real(group, full, shard)

        commsched.comm.point_to_point.all_gather = counted

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:  # the first step is taken whole: every bucket's all-gather waited for
            self.per_step = self.calls
            print(f"commsched-test: {self.per_step} all-gathers a step", flush=True)


def chain_run(mode: str, out: str) -> None:
    """The `gather-*` modes and their reference."""
    pl.seed_everything(0, verbose=False)
    if (
        mode == "chain-reference"
    ):  # the weights after 3 steps; the buffers after the 4th forward, which the failure interrupts
        strategy, callbacks, steps = (
            "ddp",
            [ModelCheckpoint(dirpath=out, filename="reference", every_n_train_steps=3)],
            4,
        )
    else:
        strategy = commsched.DeARStrategy(
            bucket_cap_mb=1e-4,
            timeout=timedelta(seconds=15),
            dear=commsched.DeAROptions(fallback="never", rollback=not mode.endswith("no-rollback")),
        )
        callbacks = [OnExceptionCheckpoint(dirpath=out)] + (
            [DiesBetweenGathers()] if os.environ.get("LOCAL_RANK") == "1" else []
        )
        steps = 20
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=out,
    )
    trainer.fit(Chain())
    if mode == "chain-reference":
        trainer.save_checkpoint(Path(out) / "after-forward-4.ckpt")
    else:
        print("commsched-test: training finished without the expected error")


class FusedAdamToyNet(ToyNet):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)  # unscales inside its own step


def model_for(mode: str) -> pl.LightningModule:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if mode == "fused-fp16":
        return FusedAdamToyNet()
    if mode == "lbfgs":
        return ToyNet(optimizer="lbfgs")
    if mode == "lazy":
        model = ToyNet()
        model.lazy = torch.nn.LazyLinear(2)  # never run before fit: its parameters are not made yet
        return model
    if mode == "plan-mismatch":
        model = ToyNet()
        if rank == 1:
            model.extra = torch.nn.Linear(2, 2)  # a parameter rank 0 does not have
        return model
    return DiesAtStep3(mode.removeprefix("peer-").removesuffix("-saved"))


def main() -> None:
    mode = sys.argv[1]
    atexit.register(report_issuer_threads)
    watch_workers_slowly()
    if mode.startswith(("gather-", "chain-")):
        return chain_run(mode, sys.argv[2])
    pl.seed_everything(0, verbose=False)
    strategy = commsched.DeARStrategy(timeout=timedelta(seconds=15))
    callbacks = [OnExceptionCheckpoint(dirpath=sys.argv[2])] if mode.endswith("-saved") else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=sys.argv[2],
        # fp16 with torch's GradScaler (Trainer(precision="16-mixed") on CPU is turned into bf16 by Lightning)
        plugins=[MixedPrecision("16-mixed", "cpu")] if mode == "fused-fp16" else None,
    )
    trainer.fit(model_for(mode))
    print("commsched-test: training finished without the expected error")


if __name__ == "__main__":
    main()
