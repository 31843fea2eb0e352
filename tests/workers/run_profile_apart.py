"""The profiler on a device where layer timing distorts the step (a GPU's: each layer hook waits for
it), played on the CPU by naming the CPU such a device: steps timed layer by layer alternate with
steps timed whole, and each training step records whether the layer hooks were on its module.

Usage: python run_profile_apart.py OUT_DIR STEPS

Writes OUT_DIR/profile/profile.json and OUT_DIR/hooked.rank{r}.pt (per training step: hooks on).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

import commsched
from commsched.profile import run_profiler

sys.path.insert(0, str(Path(__file__).parent))
from toy import ToyNet  # noqa: E402

warnings.filterwarnings("ignore")


class Watched(ToyNet):
    """ToyNet that notes, at each training step, whether a layer timer's hooks are on its head."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hooked: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.hooked.append(bool(self.head._forward_pre_hooks))
        return super().training_step(batch, batch_idx)


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    run_profiler.LAYERS_APART_ON = frozenset({"cpu"})
    pl.seed_everything(3, verbose=False)
    model = Watched(batch_size=4, train_size=4 * 2 * 40)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=commsched.WFBPStrategy(
            bucket_cap_mb=600 / 2**20, profile=commsched.ProfileOptions(steps=steps, dir=str(out / "profile"))
        ),
        max_steps=3 * steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=out,
    )
    trainer.fit(model)
    torch.save(model.hooked, out / f"hooked.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
