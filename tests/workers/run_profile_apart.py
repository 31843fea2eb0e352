"""The profiler on a device where layer timing distorts the step (a GPU's: each layer hook waits for
it), played on the CPU by naming the CPU such a device: steps timed layer by layer alternate with
steps timed whole, and each training step records whether the layer hooks were on its module.

Usage: python run_profile_apart.py OUT_DIR STEPS [gan]

`gan`: a step of two backwards, each stepping its own optimizer (manual optimization), the second
through a backward that sleeps SLOW_BACKWARD_S: a step's record holds both.

Writes OUT_DIR/profile/profile.json and OUT_DIR/hooked.rank{r}.pt (per training step: hooks on).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

import commsched
from commsched.profile import run_profiler

sys.path.insert(0, str(Path(__file__).parent))
from toy import ToyNet  # noqa: E402

warnings.filterwarnings("ignore")
SLOW_BACKWARD_S = 0.03


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLOW_BACKWARD_S)
        return grad


class Watched(ToyNet):
    """ToyNet that notes, at each training step, whether a layer timer's hooks are on its head."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hooked: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.hooked.append(bool(self.head._forward_pre_hooks))
        return super().training_step(batch, batch_idx)


class TwoBackwards(pl.LightningModule):
    """A GAN's shape: two parts, two optimizers, two backwards a step (manual optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 1)
        self.head = self.second
        self.hooked: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.hooked.append(bool(self.head._forward_pre_hooks))
        (x,) = batch
        first, second = self.optimizers()
        self.manual_backward(self.first(x).pow(2).mean())
        first.step()
        first.zero_grad()
        self.manual_backward(F.softplus(SlowBackward.apply(self.second(x))).mean())
        second.step()
        second.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.first.parameters(), lr=0.1), torch.optim.SGD(self.second.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(400, 8, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=4)


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    run_profiler.LAYERS_APART_ON = frozenset({"cpu"})
    pl.seed_everything(3, verbose=False)
    model = TwoBackwards() if sys.argv[3:] == ["gan"] else Watched(batch_size=4, train_size=4 * 2 * 40)
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
