"""One rank of a two-rank run on one GPU, for what must hold across processes beyond equality with ddp:
a peer that dies mid-step, and Ctrl-C with its resume. Started once per rank with `NODE_RANK`,
`MASTER_ADDR` and `MASTER_PORT` set (tests/gpu/test_two_ranks.py): each rank is a node of its own whose
one device is `cuda:0`, and the ranks talk over gloo (NCCL refuses two ranks on one GPU).

Usage: python run_gpu_pair.py MODE OUT_DIR [STEPS [CHECKPOINT]]
  peer-dies    DeAR; rank 1 leaves the run in step 3's backward (`os._exit`), once the buckets whose
               gradients came first are on the network: rank 0 must end with the error.
  interrupt    DeAR with `StopAndSave` into OUT_DIR, for ever: writes OUT_DIR/started once at step 5
               (the test then sends Ctrl-C to both ranks' process group).
  resume       from CHECKPOINT to step STEPS; each rank saves OUT_DIR/final.rank<r>.pt.
  whole        from the start to step STEPS, uninterrupted; the same files.
`COMMSCHED_TEST_ACCELERATOR=cpu` runs it on the CPU (the harness, on a machine without a GPU).
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch

import commsched
from commsched.data import ResumableDataLoader

sys.path.insert(0, str(Path(__file__).parent))
from exit_report import report_issuer_threads  # noqa: E402
from toy import ToyData, ToyNet  # noqa: E402

ACCELERATOR = os.environ.get("COMMSCHED_TEST_ACCELERATOR", "gpu")
BATCH = 4
STARTED_AT = 5


class DiesInBackward(ToyNet):
    """Rank 1 exits in the middle of step 3's backward: when the first layer's gradient is ready, the
    last of the step's gradients, after the other buckets' exchanges were started."""

    def on_train_start(self) -> None:
        if self.global_rank == 1:
            self.conv.weight.register_post_accumulate_grad_hook(self._maybe_die)

    def _maybe_die(self, _param: torch.Tensor) -> None:
        if self.global_step == 3:
            os._exit(17)


class ResumableToyNet(ToyNet):
    """The toy on a loader that a mid-epoch checkpoint resumes at its batch (a plain one restarts the epoch)."""

    def train_dataloader(self):
        return ResumableDataLoader(ToyData(self.hparams.train_size, seed=1), batch_size=BATCH, shuffle=True)


class SaysStarted(pl.Callback):
    """Rank 0 writes `started` once the run is well under way: the moment to press Ctrl-C."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_rank == 0 and trainer.global_step == STARTED_AT:
            (self.out / "started").write_text(str(trainer.global_step))


def trainer(out: Path, steps: int, callbacks: list, timeout_s: Optional[float] = None) -> pl.Trainer:
    strategy = commsched.DeARStrategy(
        process_group_backend="gloo",
        **({"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}),
    )
    return pl.Trainer(
        accelerator=ACCELERATOR,
        devices=1,
        num_nodes=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=0.5,
        callbacks=callbacks,
        default_root_dir=out,
    )


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    if mode == "peer-dies":
        atexit.register(report_issuer_threads)
        trainer(out, 20, [], timeout_s=15).fit(DiesInBackward())
        print("commsched-test: training finished without the expected error")
        return
    model = ResumableToyNet(batch_size=BATCH, train_size=BATCH * 2 * 50)  # 50 steps an epoch: the stop lands mid-epoch
    if mode == "interrupt":
        trainer(out, 100_000, [commsched.StopAndSave(dirpath=out), SaysStarted(out)]).fit(model)
        return
    steps = int(sys.argv[3])
    run = trainer(out, steps, [])
    run.fit(model, ckpt_path=sys.argv[4] if mode == "resume" else None)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    momenta = {
        f"{i}.{name}": t.detach().cpu().clone()
        for i, entry in run.optimizers[0].state_dict()["state"].items()
        for name, t in entry.items()
        if isinstance(t, torch.Tensor)
    }
    torch.save(
        {"state": state, "momenta": momenta, "step": run.global_step, "device": str(run.strategy.root_device)},
        out / f"final.rank{run.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
