"""Sparse embeddings (`nn.Embedding(sparse=True)`, `nn.EmbeddingBag(sparse=True)`) under each strategy, for
test_sparse_gradients.py.

Usage: python run_sparse.py OUT_DIR CASE [CASE ...]   (a case: PATTERN-STRATEGY[-resume])

STRATEGY: ddp (Lightning's), wfbp, dear, deft, defaults (dear with nothing set), traced (wfbp recording its
collectives), topk and hook (PowerSGD's; both refused: the message is saved).
PATTERN:
- sgd: a recommender's shape: an embedding (with a padding row) and an embedding bag, both sparse, into an
  MLP; one SGD; two micro-batches per step;
- adagrad: the same with Adagrad (which keeps per-row state for sparse gradients);
- tied: sgd whose loss also reads the item table whole (its gradient turns dense: refused at the first
  backward, the message saved);
- split: manual optimization, SparseAdam on the embeddings and Adam on the MLP (what sparse embeddings are
  trained with), stepped after one backward;
- fabric: a Fabric loop, `fabric.setup(model, sparse_adam, adam)`; fabric1: `fabric.setup(model, sgd)`;
  fabricapart: the tables and the MLP set up as two modules (the tables' module has no dense parameter),
  one SGD over both.
A case ending in ``-resume`` trains half the steps, saves a checkpoint, and a new Trainer resumes from it.
Every rank writes OUT_DIR/<case>.rank<r>.pt: weights, optimizer states, the collectives it issued (traced).

The Trainer's cases run where `COMMSCHED_TEST_ACCELERATOR` says (default cpu); with
`COMMSCHED_TEST_SHARED_GPU=1` each rank is a node of its own (`NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`)
on one device, every strategy over gloo: two ranks sharing one GPU (tests/gpu/test_two_ranks.py).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.utils.data import TensorDataset

import commsched
from commsched.data import ResumableDataLoader
from commsched.errors import ScheduleError
from optimizer_states import flat

warnings.filterwarnings("ignore")
STEPS, HALF, BATCH, ROWS = 8, 4, 8, 400
ACCELERATOR = os.environ.get("COMMSCHED_TEST_ACCELERATOR", "cpu")
SHARED = os.environ.get("COMMSCHED_TEST_SHARED_GPU") == "1"
"""Every rank a node of its own on the one device, over gloo (else 2 local workers)."""


class Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = nn.Embedding(ROWS, 8, sparse=True, padding_idx=0)
        self.tags = nn.EmbeddingBag(60, 8, mode="sum", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, items: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.items(items).mean(1), self.tags(tags)], 1))


class Tables(nn.Module):
    """A recommender's tables as a module of their own (no dense parameter)."""

    def __init__(self, items: nn.Embedding, tags: nn.EmbeddingBag) -> None:
        super().__init__()
        self.items, self.tags = items, tags

    def forward(self, items: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.items(items).mean(1), self.tags(tags)], 1)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    items = torch.randint(0, 40, (STEPS * BATCH * 4, 5), generator=g)  # a few of the rows: the gradient is sparse
    return TensorDataset(
        items, torch.randint(0, 60, (len(items), 4), generator=g), torch.randn(len(items), 1, generator=g)
    )


class Lit(pl.LightningModule):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.net = Recommender()
        self.pattern = pattern
        self.automatic_optimization = pattern != "split"

    def training_step(self, batch, index):
        items, tags, target = batch
        loss = F.mse_loss(self.net(items, tags), target)
        if self.pattern == "tied":  # the item table also read whole, as an output layer tied to it would
            loss = loss + 1e-3 * self.net.items.weight[:, 0].sum()
        if self.automatic_optimization:
            return loss
        sparse, dense = self.optimizers()
        self.manual_backward(loss)
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()

    def configure_optimizers(self):
        if self.pattern == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=0.1)
        if self.pattern == "split":
            embeddings = [*self.net.items.parameters(), *self.net.tags.parameters()]
            return torch.optim.SparseAdam(embeddings, lr=0.01), torch.optim.Adam(self.net.mlp.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1)


def strategy_for(name: str):
    common = {"process_group_backend": "gloo"} if SHARED else {}
    if name == "ddp":
        return DDPStrategy(**common) if SHARED else "ddp"
    if name == "defaults":
        return commsched.DeARStrategy(**common) if SHARED else "dear"
    if name == "traced":
        return commsched.WFBPStrategy(trace_collectives=True, **common)
    if name == "topk":
        return commsched.WFBPStrategy(compression="topk", **common)
    if name == "hook":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return commsched.WFBPStrategy(ddp_comm_hook=powerSGD_hook.powerSGD_hook, ddp_comm_state=state, **common)
    return commsched.CommSchedStrategy(schedule=name, fusion="fixed", bucket_cap_mb=0.0004, **common)


def trainer(name: str, steps: int, out: Path, accumulate: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator=ACCELERATOR,
        devices=1 if SHARED else 2,
        num_nodes=2 if SHARED else 1,
        strategy=strategy_for(name),
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )


def run_trainer(out: Path, case: str, pattern: str, name: str) -> dict:
    accumulate = 1 if pattern == "split" else 2
    loader = ResumableDataLoader(dataset(), batch_size=BATCH)
    model = Lit(pattern)
    if case.endswith("-resume"):
        first = trainer(name, HALF, out, accumulate)
        first.fit(model, loader)
        checkpoint = out / f"{case}.ckpt"
        first.save_checkpoint(checkpoint)
        model, fit = Lit(pattern), trainer(name, STEPS, out, accumulate)
        fit.fit(model, ResumableDataLoader(dataset(), batch_size=BATCH), ckpt_path=checkpoint)
    else:
        fit = trainer(name, STEPS, out, accumulate)
        fit.fit(model, loader)
    optimizers = fit.optimizers
    initial = Recommender().state_dict()
    return {
        "rank": fit.global_rank,
        "moved": {k: (v - initial[k]).abs().max().item() for k, v in model.net.state_dict().items()},
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": {k: v.cpu() for k, v in flat({str(i): o for i, o in enumerate(optimizers)}).items()},
        "device": str(next(model.parameters()).device),
        "trace": [(r.link, r.op, r.tag, r.numel) for r in getattr(fit.strategy, "collective_trace", [])],
    }


def run_fabric(name: str) -> dict:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp" if name == "ddp" else name)
    fabric.launch()
    net = Recommender()
    sparse = torch.optim.SparseAdam([*net.items.parameters(), *net.tags.parameters()], lr=0.01)
    dense = torch.optim.Adam(net.mlp.parameters(), lr=0.01)
    net, sparse, dense = fabric.setup(net, sparse, dense)
    batches = list(fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=BATCH)))
    for items, tags, target in batches[:STEPS]:
        fabric.backward(F.mse_loss(net(items, tags), target))
        sparse.step()
        dense.step()
        sparse.zero_grad()
        dense.zero_grad()
    return {
        "rank": fabric.global_rank,
        "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "optimizer": flat({"sparse": sparse, "dense": dense}),
        "trace": [],
    }


def run_fabric_one(name: str) -> dict:
    """One module, one optimizer (SGD over the tables and the MLP)."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp" if name == "ddp" else name)
    fabric.launch()
    net = Recommender()
    net, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    batches = list(fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=BATCH)))
    for items, tags, target in batches[:STEPS]:
        fabric.backward(F.mse_loss(net(items, tags), target))
        optimizer.step()
        optimizer.zero_grad()
    return {"rank": fabric.global_rank, "state": dict(net.state_dict()), "optimizer": {}, "trace": []}


def run_fabric_tables_apart(name: str) -> dict:
    """The tables and the MLP set up as two modules, one optimizer over both: the tables' module has no dense
    parameter, so only its sparse gradients say that a backward reached it."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp" if name == "ddp" else name)
    fabric.launch()
    net = Recommender()
    tables = fabric.setup_module(Tables(net.items, net.tags))
    mlp = fabric.setup_module(net.mlp)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    batches = list(fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=BATCH)))
    for items, tags, target in batches[:STEPS]:
        fabric.backward(F.mse_loss(mlp(tables(items, tags)), target))
        optimizer.step()
        optimizer.zero_grad()
    state = {f"items.{k}": v for k, v in net.items.state_dict().items()} | {
        f"mlp.{k}": v for k, v in net.mlp.state_dict().items()
    }
    return {"rank": fabric.global_rank, "state": state, "optimizer": {}, "trace": []}


FABRIC = {"fabric": run_fabric, "fabric1": run_fabric_one, "fabricapart": run_fabric_tables_apart}


def run(out: Path, case: str) -> None:
    pattern, name = case.removesuffix("-resume").split("-")
    try:
        result = FABRIC[pattern](name) if pattern in FABRIC else run_trainer(out, case, pattern, name)
    except (commsched.CommSchedConfigError, ScheduleError) as error:
        result = {"rank": int(os.environ.get("LOCAL_RANK", 0)), "refused": str(error)}
    torch.save(result, out / f"{case}.rank{result['rank']}.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for case in sys.argv[2:]:
        run(out_dir, case)
