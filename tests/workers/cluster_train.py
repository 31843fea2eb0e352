"""A plain Lightning script, as a user would write it for a cluster: `Trainer(num_nodes=N, devices=G)`.

Usage: python cluster_train.py OUT_DIR NUM_NODES DEVICES SCHEDULE [SCHEDULE ...]

Run directly it is one node; under `commsched-cluster` every node runs it with Lightning's
multi-node environment. Global rank 0 writes OUT_DIR/<schedule>.pt with the final weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

import commsched

sys.path.insert(0, str(Path(__file__).parent))
from toy import ToyNet  # noqa: E402


def main() -> None:
    out, nodes, devices, schedules = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    out.mkdir(parents=True, exist_ok=True)
    world = nodes * devices
    for schedule in schedules:
        pl.seed_everything(7, verbose=False)
        model = ToyNet(batch_size=4, train_size=4 * 8 * world)
        strategy = (
            DDPStrategy(find_unused_parameters=True)
            if schedule == "ddp"
            else commsched.STRATEGIES[schedule](bucket_cap_mb=600 / 2**20)
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            num_nodes=nodes,
            devices=devices,
            strategy=strategy,
            max_epochs=1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=out / f"{schedule}-run",
        )
        trainer.fit(model)
        if trainer.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{schedule}.pt")
            print(
                f"cluster_train: {schedule} done, world size {trainer.world_size}, node rank {trainer.node_rank}",
                flush=True,
            )


if __name__ == "__main__":
    main()
