"""PowerSGD as a DDP communication hook on wfbp's buckets, over a slow link: ms/step and how much of it the
training loop waited on communication, against the same hook under Lightning's DDP and against no hook.

Run on two emulated nodes (needs root), e.g. at 200 Mbit:

    .venv/bin/commsched-cluster --nodes 2 --rate 200mbit -- .venv/bin/python recipes/hook_overlap.py [STEPS]

The bench's small CNN (3 M parameters, SGD with momentum), PowerSGD at rank 4 from step 5 with error
feedback and warm start. Rows: Lightning's DDP with no hook; DDP with the hook (registered on CPU as
Lightning registers it on CUDA) on one bucket, the only layout DDP runs PowerSGD on over gloo (on several
buckets the hook's chained collectives interleave differently on each rank and gloo fails); wfbp with no
hook; wfbp with the hook on 4 MB buckets (each bucket's hook starts during backward, one after another) and
on one bucket. Rank 0 prints a Markdown row each: the median ms/step after the warm-up (each commsched run
also ends with its own line saying how much of a step the loop waited on communication).
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.utils.data import DataLoader

import commsched
from commsched.bench.models import BENCH_MODELS
from commsched.timing import StepTimer

warnings.filterwarnings("ignore")
BATCH = 32


class HookedDDP(DDPStrategy):
    """Lightning's DDPStrategy registering its hook on CPU as it does on CUDA."""

    def _register_ddp_hooks(self) -> None:
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


def powersgd() -> dict:
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=5)
    return {"ddp_comm_hook": powerSGD_hook.powerSGD_hook, "ddp_comm_state": state}


ROWS = {
    "ddp": lambda: DDPStrategy(),
    "ddp + PowerSGD, one bucket": lambda: HookedDDP(bucket_cap_mb=1000, **powersgd()),
    "wfbp": lambda: commsched.WFBPStrategy(),
    "wfbp + PowerSGD, 4 MB buckets": lambda: commsched.WFBPStrategy(bucket_cap_mb=4, **powersgd()),
    "wfbp + PowerSGD, one bucket": lambda: commsched.WFBPStrategy(bucket_cap_mb=1000, **powersgd()),
}


def timed(make_strategy, steps: int, nodes: int) -> float:
    pl.seed_everything(0, verbose=False)
    model, make_data = BENCH_MODELS["small_cnn"](64)
    timer = StepTimer(warmup=8, stop_after=steps)
    strategy = make_strategy()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        num_nodes=nodes,
        max_steps=steps + 50,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model, DataLoader(make_data(BATCH * nodes * (steps + 52)), batch_size=BATCH))
    return timer.median


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    results = {name: timed(make, steps, nodes) for name, make in ROWS.items()}
    if pl.utilities.rank_zero_only.rank == 0:
        print("| strategy | ms/step | against ddp |")
        print("|---|---|---|")
        for name, seconds in results.items():
            print(f"| {name} | {seconds * 1e3:.1f} | {results['ddp'] / seconds:.2f}x |")


if __name__ == "__main__":
    main()
