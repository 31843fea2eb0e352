"""wfbp and dear with several streams, fixed and searched ("auto"), against Lightning's ddp.

Usage: python run_streams.py OUT_DIR CASE [CASE ...]   (2 CPU processes, gloo)

Every rank writes OUT_DIR/<case>.rank<r>.pt: final state, collective trace, the stream control's
configuration, choice and trials, its closing line (`finish`) and files, what commsched said, and
the bytes each link (stream) sent. A case ending in "-delayed" sleeps a random, per-rank time
before every collective request; "-resumed" resumes "<case without -resumed>-part"'s last
checkpoint, "-cut-resumed" the checkpoint "-cut" saved at step CUT_AT (mid-search: the search
needs 9 steps, and "-cut" stops at CUT_STEPS, before it ends too).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import commsched
import commsched.comm.links

sys.path.insert(0, str(Path(__file__).parent))
from toy import ToyNet  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")

BUCKET_MB = 2000 / 2**20
UNIT_MB = 160 / 2**20
SEARCH = commsched.StreamOptions(
    unit_mb=UNIT_MB,
    warmup_steps=1,
    min_unit_mb=UNIT_MB,
    max_unit_mb=4 * UNIT_MB,
    max_streams=4,
    trial_steps=2,
    budget_steps=8,
    drift=0.0,
    confirm_rounds=1,
)
DRIFTING = dataclasses.replace(SEARCH, drift=0.5, drift_steps=4, retune_steps=6)
STEPS = 14
CUT_AT, CUT_STEPS = 6, 8
SUFFIXES = ("-delayed", "-resumed", "-part", "-cut", "-drift", "-profiled")
DRIFT_STEPS, SLOWER_FROM = 26, 12


class SlowerLater(pl.Callback):
    """Every step from SLOWER_FROM on takes 60 ms longer (the network got worse, say)."""

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= SLOWER_FROM:
            time.sleep(0.06)


def case_strategy(case: str):
    base = case
    for suffix in SUFFIXES:
        base = base.removesuffix(suffix)
    schedule, streams = base.split("-")
    if schedule == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    cls = {"wfbp": commsched.WFBPStrategy, "dear": commsched.DeARStrategy}[schedule]
    count = "auto" if streams == "auto" else int(streams.removeprefix("s"))
    options = (
        DRIFTING if case.endswith("-drift") else SEARCH if count == "auto" else commsched.StreamOptions(unit_mb=UNIT_MB)
    )
    profile = commsched.ProfileOptions(steps=8) if case.endswith("-profiled") else None
    return cls(
        bucket_cap_mb=BUCKET_MB,
        streams=dataclasses.replace(options, count=count),
        trace_collectives=True,
        profile=profile,
    )


def delay_every_request(rank: int) -> None:
    """Sleep 0-4 ms, drawn per rank, before each collective is requested: ranks reach each unit at different times."""
    draw = random.Random(1000 + rank)
    original = commsched.comm.links.Link._request

    def delayed(self, *args, **kwargs):
        time.sleep(draw.uniform(0, 0.004))
        return original(self, *args, **kwargs)

    commsched.comm.links.Link._request = delayed


class CountGroups(pl.Callback):
    """The process groups alive after every step (torch's own registry, not commsched's): counted at the
    step's end, after the decisions of its start (Lightning calls the callbacks' batch start before
    the strategy's, where the search switches and releases)."""

    def __init__(self) -> None:
        self.alive: list[int] = []

    def on_train_batch_end(self, *args) -> None:
        from torch.distributed.distributed_c10d import _world

        self.alive.append(len(_world.pg_map))


class Said(logging.Handler):
    """What commsched tells the user during one fit (rank 0 says it all)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def resumed_from(out: Path, case: str) -> Path | None:
    if case.endswith("-cut-resumed"):
        return out / case.removesuffix("-resumed") / "mid" / "mid.ckpt"
    if case.endswith("-resumed"):
        return out / case.replace("-resumed", "-part") / "ckpt" / "last.ckpt"
    return None


def fit(out: Path, case: str) -> None:
    pl.seed_everything(1234, verbose=False)
    steps = (
        DRIFT_STEPS
        if case.endswith("-drift")
        else STEPS - 4
        if case.endswith("-part")
        else CUT_STEPS
        if case.endswith("-cut")
        else STEPS
    )
    model = ToyNet(optimizer="sgd", batch_size=4, train_size=max(steps, STEPS) * 4 * 2)
    groups = CountGroups()
    strategy = case_strategy(case)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        gradient_clip_val=0.5,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out / case,
        callbacks=[
            groups,
            ModelCheckpoint(dirpath=out / case / "ckpt", save_last=True, save_top_k=0),
            *([SlowerLater()] if case.endswith("-drift") else []),
            *(
                [ModelCheckpoint(dirpath=out / case / "mid", filename="mid", every_n_train_steps=CUT_AT, save_top_k=-1)]
                if case.endswith("-cut")
                else []
            ),
        ],
    )
    if case.endswith("-delayed"):
        delay_every_request(trainer.global_rank)
    said = Said()
    logging.getLogger("commsched").addHandler(said)
    resume = resumed_from(out, case)
    try:
        trainer.fit(model, ckpt_path=str(resume) if resume else None)
    finally:
        logging.getLogger("commsched").removeHandler(said)
    result = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "trace": [tuple(vars(r).values()) for r in getattr(trainer.strategy, "collective_trace", [])],
        "groups_alive": groups.alive,
    }
    schedule = getattr(trainer.strategy, "last_schedule", None)
    if schedule is not None and schedule.streams is not None:
        control = schedule.streams
        result.update(
            striping=control.striping.to_json(),
            chosen=control.chosen.to_json() if control.chosen else None,
            trials=control.trials,
            wire_bytes=trainer.strategy.wire_bytes,
            profile=trainer.strategy.profile,
            finish=control.finish(),
            files=[str(p) for p in control.files()],
            said=said.lines,
        )
    torch.save(result, out / f"{case}.rank{trainer.global_rank}.pt")


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        fit(out, case)


if __name__ == "__main__":
    main()
