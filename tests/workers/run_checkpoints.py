"""Checkpoints as a user's fit leaves them, and runs stopped mid-epoch by a real SIGINT and resumed.

Usage: python run_checkpoints.py OUT_DIR        (2 processes on CPU, Lightning's launcher)

Every rank writes OUT_DIR/results.rank<r>.pt: per case, what the test reads (files, steps, final
weights, the sample indices each step took, how often each sample was loaded, warnings, the loader's
state at every step end). Rank 0 prints the closing lines the fits end with.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

import commsched
from commsched import StopAndSave, StoppedBySignal
from commsched.cli.quiet import quiet_lightning
from commsched.data import ResumableDataLoader

WORLD = 2
SAMPLES = 96  # 12 steps of 4 per epoch on each of 2 ranks
BATCH = 4
STEPS_PER_EPOCH = SAMPLES // WORLD // BATCH
WHOLE = 30  # 2.5 epochs
SIGNAL_AT = 15  # the stop is agreed two steps later: step 17, in the middle of the second epoch

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*log_every_n_steps.*")


class Counted(Dataset):
    """Fixed samples (features, label, index); counts how often each is loaded in this process."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=g)
        self.loads: Counter = Counter()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        self.loads[int(i)] += 1
        return self.x[i], self.y[i], i


class Net(pl.LightningModule):
    def __init__(self, make_loader: Any = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.seen: list[list[int]] = []
        self._make_loader = make_loader

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append(index.tolist())
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):  # only when a case makes its loader in the hook (Lightning wraps it there)
        return self._make_loader()


class Interrupt(pl.Callback):
    """Ctrl-C as a terminal sends it, to rank 0 only, at the end of step `at`."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGINT)


class LoaderStates(pl.Callback):
    """The training loader's state at every step end (what a checkpoint written there would hold)."""

    def __init__(self) -> None:
        self.states: list[tuple[int, dict]] = []
        self.loader_type = self.sampler_type = ""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loader = trainer.train_dataloader
        self.loader_type, self.sampler_type = type(loader).__name__, type(loader.sampler).__name__
        if hasattr(loader, "state_dict"):
            self.states.append((batch_idx, dict(loader.state_dict())))


def fit(
    out: Path,
    case: str,
    *,
    loader: str = "resumable",
    steps: int = WHOLE,
    epochs: Optional[int] = None,
    callbacks: Optional[list] = None,
    checkpoint: Optional[dict] = None,
    resume: Optional[Path] = None,
    logger: Any = False,
    strategy: str = "dear",
    workers: int = 0,
    in_hook: bool = False,
) -> dict:
    pl.seed_everything(7, verbose=False)
    data = Counted()
    cls = ResumableDataLoader if loader == "resumable" else DataLoader

    def make() -> DataLoader:
        # Workers from a fork server, not forked from this process: forked beside gloo's and commsched's
        # threads, a worker died of a segmentation fault in one of three runs of this file (not seen in
        # twelve runs of the case alone, dear or ddp); what is tested here is resuming under the
        # workers' prefetching, not fork safety.
        context = "forkserver" if workers else None
        return cls(
            data,
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            multiprocessing_context=context,
        )

    model = Net(make)
    states = LoaderStates()
    checkpoints = [ModelCheckpoint(**checkpoint)] if checkpoint is not None else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        max_epochs=epochs,
        logger=logger,
        default_root_dir=out / case,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        enable_checkpointing=bool(checkpoints),
        callbacks=[*(callbacks or []), states, *checkpoints],
    )
    stopped = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, None if in_hook else make(), ckpt_path=str(resume) if resume else None)
        except StoppedBySignal as stop:
            stopped = {"step": stop.step, "saved": stop.saved}
    files = sorted(str(p.relative_to(out / case)) for p in (out / case).rglob("*.ckpt"))
    return {
        "stopped": stopped,
        "global_step": trainer.global_step,
        "files": files,
        "seen": model.seen,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "loads": dict(data.loads),
        "warnings": [str(w.message) for w in caught],
        "loader_states": states.states,
        "loader_type": states.loader_type,
        "sampler_type": states.sampler_type,
        "dirpath": str(checkpoints[0].dirpath) if checkpoints else None,
        "stop_path": str(next((c.path for c in trainer.callbacks if isinstance(c, StopAndSave)), "")),
        "run_folder": str(commsched.run_files.folder_of(trainer)),
    }


def main() -> None:
    out = Path(sys.argv[1])
    quiet_lightning()
    results: dict[str, Any] = {}

    # One `last`: a ModelCheckpoint that keeps it, and StopAndSave beside it.
    results["epoch-cadence"] = fit(
        out,
        "epoch-cadence",
        steps=20,
        callbacks=[StopAndSave()],
        checkpoint=dict(dirpath=out / "epoch-cadence" / "ckpt", save_last=True, save_top_k=0),
    )
    results["step-cadence"] = fit(
        out,
        "step-cadence",
        steps=20,
        callbacks=[StopAndSave()],
        checkpoint=dict(dirpath=out / "step-cadence" / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=7),
    )
    results["top-k"] = fit(
        out,
        "top-k",
        steps=-1,
        epochs=2,
        callbacks=[StopAndSave()],
        checkpoint=dict(dirpath=out / "top-k" / "ckpt", save_last=True),
    )
    results["ddp"] = fit(
        out,
        "ddp",
        steps=20,
        strategy="ddp",
        callbacks=[StopAndSave()],
        checkpoint=dict(dirpath=out / "ddp" / "ckpt", save_last=True, save_top_k=0),
    )

    # StopAndSave() finds the folder: the ModelCheckpoint's (here the logger's version folder), else the run's.
    results["logged"] = fit(
        out,
        "logged",
        steps=8,
        callbacks=[StopAndSave()],
        logger=CSVLogger(out / "logged" / "logs"),
        checkpoint=dict(save_last=True, save_top_k=0),
    )
    results["logged-resumed"] = fit(
        out,
        "logged",
        steps=12,
        callbacks=[StopAndSave()],
        logger=CSVLogger(out / "logged" / "logs"),
        checkpoint=dict(save_last=True, save_top_k=0),
        resume=Path(results["logged"]["stop_path"]),
    )
    results["alone"] = fit(out, "alone", steps=8, callbacks=[StopAndSave()], logger=CSVLogger(out / "alone" / "logs"))

    # Stopped mid-epoch by Ctrl-C and resumed, against the run that was not stopped.
    for loader, workers, in_hook in (("resumable", 0, False), ("resumable", 2, True), ("plain", 0, False)):
        name = f"{loader}-w{workers}"
        keep = dict(save_last=True, save_top_k=0)
        results[f"{name}-whole"] = fit(
            out,
            f"{name}-whole",
            loader=loader,
            workers=workers,
            in_hook=in_hook,
            checkpoint=dict(dirpath=out / f"{name}-whole", **keep),
        )
        stopped = results[f"{name}-stopped"] = fit(
            out,
            f"{name}-stopped",
            loader=loader,
            workers=workers,
            in_hook=in_hook,
            callbacks=[Interrupt(SIGNAL_AT), StopAndSave()],
            checkpoint=dict(dirpath=out / f"{name}-stopped", **keep),
        )
        assert stopped["stopped"] is not None, f"{name}: the run was not stopped"
        results[f"{name}-resumed"] = fit(
            out,
            f"{name}-resumed",
            loader=loader,
            workers=workers,
            in_hook=in_hook,
            callbacks=[StopAndSave()],
            checkpoint=dict(dirpath=out / f"{name}-resumed", **keep),
            resume=Path(stopped["stopped"]["saved"]),
        )

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.save(results, out / f"results.rank{rank}.pt")


if __name__ == "__main__":
    main()
