"""Fabric loops over several modules or optimizers under each strategy, for test_fabric_parts.py.

Usage: python run_fabric_parts.py OUT_DIR CASE [CASE ...]

CASE: PATTERN-STRATEGY[-first|-resumed], STRATEGY one of ddp, wfbp, dear, deft, streams (dear on 2 streams),
traced (dear, recording its collectives), compiled (dear, dcgan's modules given to `fabric.setup` compiled),
topk (refused: its message is saved).
PATTERN:
- dcgan: the loop of Lightning's Fabric DCGAN example: a generator and a discriminator (both with
  BatchNorm) set up apart, each with its Adam; the discriminator steps after two backwards (real, then a
  detached fake), the generator after a backward through the discriminator.
- shared: an encoder and a decoder set up apart (`fabric.setup_module`), one SGD with momentum over both
  (`fabric.setup_optimizers`), two micro-batches under `fabric.no_backward_sync` of both, clipping by norm.
- twoopts: one module, two optimizers (AdamW on the body, SGD on the head) stepped after one backward.
- optfirst: twoopts with the optimizers set up before the module (`fabric.setup_optimizers` first).
- teacher: a frozen module set up after the student; tied: two modules sharing a layer (both refused: the
  message is saved).
`-first` trains the first HALF steps and saves with `fabric.save`; `-resumed` loads it in a new run and
trains the rest. Every rank writes OUT_DIR/<case>.rank<r>.pt: the modules' states and the optimizers'.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import commsched
from optimizer_states import flat

warnings.filterwarnings("ignore")
STEPS, HALF, BATCH, LATENT, FEATURES = 8, 4, 8, 6, 12


def strategy_for(name: str):
    if name == "streams":
        return commsched.DeARFabricStrategy(streams=commsched.StreamOptions(count=2))
    if name == "compiled":
        return "dear"
    if name == "traced":
        return commsched.DeARFabricStrategy(trace_collectives=True)
    if name == "topk":
        return commsched.WFBPFabricStrategy(compression="topk")
    return name


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(STEPS * BATCH * 2, FEATURES, generator=generator)), batch_size=BATCH)


def dcgan_nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(
        nn.Linear(LATENT, 24, bias=False), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, FEATURES), nn.Tanh()
    )
    discriminator = nn.Sequential(
        nn.Linear(FEATURES, 24, bias=False), nn.BatchNorm1d(24), nn.LeakyReLU(0.2), nn.Linear(24, 1), nn.Sigmoid()
    )
    return generator, discriminator


def dcgan(
    fabric: Fabric, start: int, stop: int, checkpoint: Path, resumed: bool, first: bool, compiled: bool = False
) -> dict:
    netG, netD = dcgan_nets()
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    if compiled:
        netG, netD = torch.compile(netG), torch.compile(netD)
    netG, optG = fabric.setup(netG, optG)
    netD, optD = fabric.setup(netD, optD)
    state = {"generator": netG, "discriminator": netD, "optimizer_g": optG, "optimizer_d": optD}
    if resumed:
        fabric.load(checkpoint, state)
    batches = list(fabric.setup_dataloaders(data()))
    for step in range(start, stop):
        noise_gen = torch.Generator().manual_seed(100 * step + fabric.global_rank)
        (real,) = batches[step]
        netD.zero_grad()
        output = netD(real)
        errD_real = F.binary_cross_entropy(output, torch.ones_like(output))
        fabric.backward(errD_real)
        fake = netG(torch.randn(BATCH, LATENT, generator=noise_gen))
        output = netD(fake.detach())
        errD_fake = F.binary_cross_entropy(output, torch.zeros_like(output))
        fabric.backward(errD_fake)
        optD.step()
        netG.zero_grad()
        output = netD(fake)
        errG = F.binary_cross_entropy(output, torch.ones_like(output))
        fabric.backward(errG)
        optG.step()
    if first:
        fabric.save(checkpoint, state)
    initial = [net.state_dict() for net in dcgan_nets()]
    moved = max(
        (v - initial[i][k]).abs().max().item()
        for i, net in enumerate((netG, netD))
        for k, v in net.state_dict().items()
    )
    return {
        "state": {f"g.{k}": v for k, v in netG.state_dict().items()}
        | {f"d.{k}": v for k, v in netD.state_dict().items()},
        "optimizer": flat({"g": optG, "d": optD}),
        "moved": moved,
        "sizes": {"g": sum(p.numel() for p in netG.parameters()), "d": sum(p.numel() for p in netD.parameters())},
    }


def shared(fabric: Fabric, start: int, stop: int, checkpoint: Path, resumed: bool, first: bool) -> dict:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 4))
    decoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, FEATURES))
    encoder, decoder = fabric.setup_module(encoder), fabric.setup_module(decoder)
    optimizer = torch.optim.SGD([*encoder.parameters(), *decoder.parameters()], lr=0.1, momentum=0.9)
    optimizer = fabric.setup_optimizers(optimizer)
    state = {"encoder": encoder, "decoder": decoder, "optimizer": optimizer}
    if resumed:
        fabric.load(checkpoint, state)
    batches = list(fabric.setup_dataloaders(data()))
    for step in range(start, stop):
        (x,) = batches[step]
        for micro, part in enumerate(x.chunk(2)):
            local = micro == 0
            with fabric.no_backward_sync(encoder, enabled=local), fabric.no_backward_sync(decoder, enabled=local):
                fabric.backward(F.mse_loss(decoder(encoder(part)), part) / 2)
        fabric.clip_gradients(encoder, optimizer, max_norm=0.3)
        optimizer.step()
        optimizer.zero_grad()
    if first:
        fabric.save(checkpoint, state)
    return {
        "state": {f"e.{k}": v for k, v in encoder.state_dict().items()}
        | {f"d.{k}": v for k, v in decoder.state_dict().items()},
        "optimizer": flat({"o": optimizer}),
    }


def twoopts(
    fabric: Fabric, start: int, stop: int, checkpoint: Path, resumed: bool, first: bool, optimizers_first: bool = False
) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    body = torch.optim.AdamW([*model[0].parameters(), *model[2].parameters()], lr=1e-2)
    head = torch.optim.SGD(model[4].parameters(), lr=0.05, momentum=0.9)
    if optimizers_first:  # which Fabric's ddp allows
        body, head = fabric.setup_optimizers(body, head)
        model = fabric.setup_module(model)
    else:
        model, body, head = fabric.setup(model, body, head)
    state = {"model": model, "body": body, "head": head}
    if resumed:
        fabric.load(checkpoint, state)
    batches = list(fabric.setup_dataloaders(data()))
    for step in range(start, stop):
        (x,) = batches[step]
        y = model(x).squeeze(1)
        fabric.backward(0.1 * y.pow(2).mean() + (x.sum(1) - y).pow(2).mean())
        body.step()
        head.step()
        body.zero_grad()
        head.zero_grad()
    if first:
        fabric.save(checkpoint, state)
    return {"state": dict(model.state_dict()), "optimizer": flat({"body": body, "head": head})}


def optfirst(fabric: Fabric, start: int, stop: int, checkpoint: Path, resumed: bool, first: bool) -> dict:
    return twoopts(fabric, start, stop, checkpoint, resumed, first, optimizers_first=True)


def tied(fabric: Fabric, start: int, stop: int, checkpoint: Path, resumed: bool, first: bool) -> dict:
    """Two modules set up apart that share a layer (refused: its message is saved)."""
    shared = nn.Linear(FEATURES, FEATURES)
    encoder = fabric.setup_module(nn.Sequential(shared, nn.Tanh()))
    fabric.setup_module(nn.Sequential(nn.Linear(FEATURES, FEATURES), shared))
    return {"state": dict(encoder.state_dict())}


def teacher(fabric: Fabric, start: int, stop: int, checkpoint: Path, resumed: bool, first: bool) -> dict:
    """A frozen teacher given to `fabric.setup_module` (refused, as under Fabric's ddp)."""
    student = fabric.setup_module(nn.Linear(FEATURES, 1))
    fabric.setup_module(nn.Linear(FEATURES, 1).requires_grad_(False))
    return {"state": dict(student.state_dict())}


PATTERNS = {
    "dcgan": dcgan,
    "shared": shared,
    "twoopts": twoopts,
    "optfirst": optfirst,
    "teacher": teacher,
    "tied": tied,
}


def run(out: Path, case: str) -> None:
    pattern, name, *phase = case.split("-")
    first, resumed = phase == ["first"], phase == ["resumed"]
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy_for(name))
    fabric.launch()
    start, stop = (HALF if resumed else 0), (HALF if first else STEPS)
    try:
        compiled = {"compiled": True} if name.endswith("compiled") else {}
        result = PATTERNS[pattern](fabric, start, stop, out / f"{pattern}-{name}.ckpt", resumed, first, **compiled)
    except commsched.CommSchedConfigError as error:
        result = {"refused": str(error)}
    strategy = fabric.strategy
    result["ran"] = strategy.schedule.name if getattr(strategy, "schedule", None) is not None else "ddp"
    result["trace"] = [(r.link, r.op, r.tag, r.numel) for r in getattr(strategy, "collective_trace", [])]
    torch.save(result, out / f"{case}.rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for case in sys.argv[2:]:
        run(out_dir, case)
