"""gan.py: a GAN trained by hand (two optimizers, Lightning's manual optimization) with `strategy="dear"`.

The module is written as Lightning's GAN example writes one: `automatic_optimization = False`, a
generator step and a discriminator step on every batch, each inside `toggle_optimizer` /
`untoggle_optimizer`. Nothing in it knows about commsched. The data is scikit-learn's handwritten
digits (real 8x8 images, shipped with the library); a callback of the script's own times each batch.

Under Lightning's ddp (with `find_unused_parameters=True`, which a GAN needs there) each of the two
backwards averages every bucket, the switched-off half's zeros included. Under commsched each half's
buckets are sent once a batch, and the model is ddp's.

    python examples/gan.py                          # 2 CPU processes
    python examples/gan.py --strategy ddp           # the same run under Lightning's ddp
    commsched-cluster --nodes 2 --rate 1gbit -- python examples/gan.py --num-nodes 2 --devices 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import commsched  # noqa: F401  (registers "wfbp", "dear", "deft", "topk" with Lightning)

LATENT = 64


class DigitsGAN(pl.LightningModule):
    """A generator of 8x8 digit images from noise, and a discriminator telling them from real ones."""

    def __init__(self, width: int = 512, lr: float = 2e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(
            nn.Linear(LATENT, width),
            nn.BatchNorm1d(width),
            nn.ReLU(),
            nn.Linear(width, 2 * width),
            nn.BatchNorm1d(2 * width),
            nn.ReLU(),
            nn.Linear(2 * width, 64),
            nn.Tanh(),
        )
        self.discriminator = nn.Sequential(
            nn.Linear(64, 2 * width),
            nn.LeakyReLU(0.2),
            nn.Linear(2 * width, width),
            nn.LeakyReLU(0.2),
            nn.Linear(width, 1),
        )

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], LATENT, device=real.device)
        ones = torch.ones(real.shape[0], 1, device=real.device)

        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), torch.zeros_like(ones))
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self):
        betas = (0.5, 0.999)
        return (
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas),
        )


class BatchClock(pl.Callback):
    """The script's own callback: each training batch's wall time."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def digits() -> TensorDataset:
    """The 1,797 digit images, flattened, scaled to [-1, 1] as the generator's tanh draws them."""
    images = torch.tensor(load_digits().images, dtype=torch.float32).flatten(1) / 8.0 - 1.0
    return TensorDataset(images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="dear", help="dear, wfbp, deft or Lightning's ddp")
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (under commsched-cluster)")
    parser.add_argument("--batches", type=int, default=40, help="training batches (two optimizer steps each)")
    parser.add_argument("--width", type=int, default=512, help="hidden width of both networks")
    args = parser.parse_args()

    pl.seed_everything(0)
    clock = BatchClock()
    trainer = pl.Trainer(
        strategy=DDPStrategy(find_unused_parameters=True) if args.strategy == "ddp" else args.strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=2 * args.batches,  # Lightning counts each optimizer's steps
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DigitsGAN(args.width)
    trainer.fit(model, DataLoader(digits(), batch_size=64, shuffle=True, drop_last=True))
    if trainer.is_global_zero:
        steady = clock.seconds[len(clock.seconds) // 4 :]  # after warm-up and the first choices
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        print(
            f"{args.strategy}: {statistics.median(steady) * 1e3:.1f} ms a batch (median of the last {len(steady)}), "
            f"weights checksum {checksum:.6f}"
        )


if __name__ == "__main__":
    main()
