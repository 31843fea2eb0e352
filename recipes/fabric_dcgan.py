"""The loop of Lightning's Fabric DCGAN example, timed: `Fabric(strategy=...)` at its defaults, `ddp` against
`dear` (which serves two modules with WFBP, as ddp's per-module wrappers average them).

The networks are the example's (generator and discriminator of transposed and strided convolutions with
BatchNorm, ngf = ndf = 64, 3.6 M and 2.8 M parameters) at 32 x 32 (one block fewer), batch 16 of noise
images; Adam(2e-4, betas (0.5, 0.999)) for each. Each run prints its median step over the second half of
its steps and a checksum of both networks' weights.

    .venv/bin/python recipes/fabric_dcgan.py --strategy dear               # two processes on the loopback
    commsched-cluster --nodes 2 --rate 1gbit -- python recipes/fabric_dcgan.py --strategy dear --num-nodes 2 --devices 1
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

import commsched  # noqa: F401  (registers "dear")

LATENT, NGF, NDF, BATCH = 100, 64, 64, 16


def generator() -> nn.Module:
    def up(i: int, o: int, first: bool = False) -> list[nn.Module]:
        conv = nn.ConvTranspose2d(i, o, 4, 1 if first else 2, 0 if first else 1, bias=False)
        return [conv, nn.BatchNorm2d(o), nn.ReLU(True)]

    return nn.Sequential(
        *up(LATENT, NGF * 4, first=True), *up(NGF * 4, NGF * 2), *up(NGF * 2, NGF),
        nn.ConvTranspose2d(NGF, 3, 4, 2, 1, bias=False), nn.Tanh(),
    )  # fmt: skip


def discriminator() -> nn.Module:
    def down(i: int, o: int, norm: bool = True) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 4, 2, 1, bias=False), *([nn.BatchNorm2d(o)] if norm else []), nn.LeakyReLU(0.2, True)]

    return nn.Sequential(
        *down(3, NDF, norm=False), *down(NDF, NDF * 2), *down(NDF * 2, NDF * 4),
        nn.Conv2d(NDF * 4, 1, 4, 1, 0, bias=False), nn.Flatten(), nn.Sigmoid(),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="dear")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    fabric = Fabric(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy)
    fabric.launch()
    torch.manual_seed(0)
    netG, netD = generator(), discriminator()
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    netG, optG = fabric.setup(netG, optG)
    netD, optD = fabric.setup(netD, optD)
    data = torch.Generator().manual_seed(fabric.global_rank)
    times = []
    for _ in range(args.steps):
        times.append(time.perf_counter())
        real = torch.rand(BATCH, 3, 32, 32, generator=data) * 2 - 1
        netD.zero_grad()
        output = netD(real)
        fabric.backward(F.binary_cross_entropy(output, torch.ones_like(output)))
        fake = netG(torch.randn(BATCH, LATENT, 1, 1, generator=data))
        output = netD(fake.detach())
        fabric.backward(F.binary_cross_entropy(output, torch.zeros_like(output)))
        optD.step()
        netG.zero_grad()
        output = netD(fake)
        fabric.backward(F.binary_cross_entropy(output, torch.ones_like(output)))
        optG.step()
    times.append(time.perf_counter())
    steps = [b - a for a, b in zip(times, times[1:])][args.steps // 2 :]
    checksum = sum(p.double().sum().item() for net in (netG, netD) for p in net.parameters())
    fabric.print(f"{args.strategy}: {statistics.median(steps) * 1e3:.1f} ms a step, weight sum {checksum:.6f}")


if __name__ == "__main__":
    main()
