"""The checkpoints a fit leaves, and resuming in the middle of an epoch.

- One `last`: `StopAndSave` beside a `ModelCheckpoint(save_last=True)` saves through it (no
  `last-v1.ckpt`), and the `last.ckpt` a fit ends with holds its final step; `StopAndSave()` finds
  the `ModelCheckpoint`'s folder (else the run's), and a run resumed into a new folder does not warn
  that the folder changed.
- `ResumableDataLoader`: a 2-process `dear` run stopped mid-epoch by a real SIGINT and resumed ends
  with the weights of the run that never stopped, no sample loaded twice, with the loader given to
  `fit` or made in the `train_dataloader` hook (Lightning rebuilds it with a DistributedSampler) and
  with worker processes prefetching; a plain DataLoader resumed the same way does not (Lightning
  replays its epoch from the first batch), which is what docs/cli.md says.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset, IterableDataset

from commsched import StopAndSave
from commsched.cli.quiet import quiet_lightning
from commsched.data import ResumableDataLoader
from conftest import max_abs_diff, run_worker

STEPS_PER_EPOCH = 12  # workers/run_checkpoints.py: 96 samples, 2 ranks, batches of 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoints")
    proc = run_worker("run_checkpoints.py", str(out))
    if proc.returncode != 0:
        pytest.fail(f"the checkpoint runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = [torch.load(out / f"results.rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    return out, results, proc.stdout


def lasts(files: list[str]) -> list[str]:
    return [f for f in files if Path(f).name.startswith("last")]


# ---------------------------------------------------------------------------------------------- one last
@pytest.mark.parametrize("case, final", [("epoch-cadence", 20), ("step-cadence", 20), ("top-k", 24), ("ddp", 20)])
def test_a_fit_ends_with_one_last_checkpoint_holding_its_final_step(runs, case, final):
    """20 steps end in the middle of the second epoch; `step-cadence` saves every 7 steps (its last at 14);
    `top-k` keeps its own epoch checkpoint beside `last`."""
    out, results, _ = runs
    result = results[0][case]
    assert result["global_step"] == final
    assert lasts(result["files"]) == ["ckpt/last.ckpt"], result["files"]
    saved = torch.load(out / case / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == final
    if case == "top-k":
        assert "ckpt/epoch=1-step=24.ckpt" in result["files"]  # the ModelCheckpoint's own epoch save still happens


def test_stop_and_save_saves_in_the_model_checkpoints_folder_else_the_runs(runs):
    _, results, _ = runs
    for rank in (0, 1):
        logged, alone = results[rank]["logged"], results[rank]["alone"]
        assert Path(logged["stop_path"]) == Path(logged["dirpath"]) / "last.ckpt"
        assert logged["files"] == ["logs/lightning_logs/version_0/checkpoints/last.ckpt"]  # nothing in ./checkpoints
        # No ModelCheckpoint at all: the run's folder (the logger's, resolved by the strategy).
        assert Path(alone["stop_path"]) == Path(alone["run_folder"]) / "checkpoints" / "last.ckpt"
        assert alone["files"] == ["logs/lightning_logs/version_0/checkpoints/last.ckpt"]
    assert not (Path(__file__).parent / "workers" / "checkpoints").exists()


def test_a_run_resumed_into_a_new_folder_does_not_warn_that_the_folder_changed(runs):
    _, results, _ = runs
    for rank in (0, 1):
        resumed = results[rank]["logged-resumed"]
        assert not [w for w in resumed["warnings"] if "dirpath has changed" in w], resumed["warnings"]
        assert Path(resumed["stop_path"]).parent.parent.name == "version_1" and resumed["global_step"] == 12


def test_a_fit_ends_with_one_line_on_how_to_continue(runs):
    """Under `ddp` StopAndSave says it; under a commsched strategy the strategy's closing summary does."""
    out, _, stdout = runs
    ours = [line for line in stdout.splitlines() if line.startswith("commsched: last checkpoint")]
    path = out / "ddp" / "ckpt" / "last.ckpt"
    assert ours == [
        f"commsched: last checkpoint {path} (step 20); continue with: trainer.fit(model, ckpt_path={str(path)!r})"
    ]
    stops = [line for line in stdout.splitlines() if line.startswith("commsched: stopped at step")]
    assert len(stops) == 3 and all("continue with: trainer.fit(model, ckpt_path=" in line for line in stops), stops


# ----------------------------------------------------------------------------------- mid-epoch resume
@pytest.mark.parametrize("name", ["resumable-w0", "resumable-w2"])
def test_ctrl_c_mid_epoch_and_resume_equals_the_run_that_never_stopped(runs, name):
    """w0: the loader given to `fit`, samples loaded in the main process (counted); w2: made in the
    `train_dataloader` hook, two worker processes prefetching."""
    out, results, _ = runs
    for rank in (0, 1):
        whole, stopped, resumed = (results[rank][f"{name}-{part}"] for part in ("whole", "stopped", "resumed"))
        step = stopped["stopped"]["step"]
        assert step == 17 and step % STEPS_PER_EPOCH != 0  # the SIGINT at step 15, stopped two steps on: mid-epoch
        assert whole["loader_type"] == "ResumableDataLoader" and whole["sampler_type"] == "DistributedSampler"
        assert stopped["seen"] + resumed["seen"] == whole["seen"]
        diff, key = max_abs_diff(resumed["state"], whole["state"])
        assert diff <= 1e-6, f"rank {rank}: {key} differs by {diff:.3g}"
        assert not [w for w in resumed["warnings"] if "not resumable" in w]
        if name == "resumable-w0":  # the skipped batches were not loaded again
            assert Counter(stopped["loads"]) + Counter(resumed["loads"]) == Counter(whole["loads"])
    saved = torch.load(out / f"{name}-stopped" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 17
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 17 - STEPS_PER_EPOCH


def test_the_loader_state_counts_the_batches_the_loop_took_not_those_prefetched(runs):
    """With two workers each prefetching two batches, the sampler runs ahead of the loop; the state a
    checkpoint would hold at every step end is the loop's count. (Lightning 2.6 prefetches a batch
    itself only from loaders without a length; this one always has one.)"""
    _, results, _ = runs
    for rank in (0, 1):
        states = results[rank]["resumable-w2-whole"]["loader_states"]
        assert len(states) == 30
        assert all(state["batches"] == batch_idx + 1 for batch_idx, state in states), states


def test_a_plain_dataloader_resumed_mid_epoch_does_not_equal_the_run_that_never_stopped(runs):
    """What docs/cli.md says: Lightning replays a non-resumable loader's epoch from its first batch."""
    _, results, _ = runs
    whole, stopped, resumed = (results[0][f"plain-w0-{part}"] for part in ("whole", "stopped", "resumed"))
    assert stopped["stopped"]["step"] == 17 and resumed["global_step"] == whole["global_step"] == 30
    assert stopped["seen"] + resumed["seen"] != whole["seen"]
    assert resumed["seen"][0] == whole["seen"][STEPS_PER_EPOCH]  # the second epoch again, from its first batch
    assert max_abs_diff(resumed["state"], whole["state"])[0] > 1e-3
    assert [w for w in resumed["warnings"] if "not resumable" in w]


# ------------------------------------------------------------------------------ the loader, in-process
class Counted(Dataset):
    def __init__(self, size: int = 40) -> None:
        self.size, self.loads = size, Counter()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        self.loads[i] += 1
        return i


def batches(loader, count=None) -> list[list[int]]:
    taken = []
    for batch in loader:
        taken.append(batch.tolist())
        if count is not None and len(taken) == count:
            break
    return taken


def test_a_loaded_state_resumes_the_pass_without_loading_the_skipped_samples():
    torch.manual_seed(0)
    whole = batches(
        ResumableDataLoader(Counted(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    )
    first = ResumableDataLoader(Counted(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    taken = batches(first, 3)
    state = first.state_dict()
    assert state["pass"] == 0 and state["batches"] == 3 and state["length"] == 10
    data = Counted()
    again = ResumableDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(99))
    again.load_state_dict(state)
    assert again.state_dict() == state  # loaded, nothing taken yet: the same position
    assert taken + batches(again) == whole  # the shuffle's seed travels in the state
    assert sorted(data.loads) == sorted(i for batch in whole[3:] for i in batch) and set(data.loads.values()) == {1}
    assert again.state_dict()["batches"] == 10 and batches(again) != whole  # then the next pass, shuffled anew


def test_a_finished_pass_resumes_at_the_next_and_another_length_is_said():
    loader = ResumableDataLoader(Counted(), batch_size=4)
    batches(loader)
    resumed = ResumableDataLoader(Counted(), batch_size=4)
    resumed.load_state_dict(loader.state_dict())
    batches(resumed)
    assert resumed.state_dict()["pass"] == 1
    smaller = ResumableDataLoader(Counted(), batch_size=8)
    smaller.load_state_dict({**loader.state_dict(), "batches": 4})
    with pytest.warns(UserWarning, match="a pass now has 5 batches, 10 when the checkpoint"):
        assert batches(smaller)[0] == list(range(16, 24))  # 4 of 10 -> 2 of 5
    with pytest.raises(TypeError, match="IterableDataset"):
        ResumableDataLoader(type("Stream", (IterableDataset,), {"__iter__": lambda self: iter(range(3))})())


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.tolist())
        return self.layer(batch.float().unsqueeze(1)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def fit_one(path: Path, steps: int = -1, epochs=None, resume=None, loader=ResumableDataLoader) -> list[list[int]]:
    pl.seed_everything(5, verbose=False)
    model = Net()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=path, save_last=True, save_top_k=0), StopAndSave()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(Counted(48), batch_size=4, shuffle=True), ckpt_path=resume)
    return model.seen


@pytest.mark.parametrize(
    "first, then",
    [
        (dict(steps=18), dict(steps=36)),  # ended by max_steps mid-epoch: Lightning counts that epoch finished
        (dict(steps=12), dict(steps=36)),  # ended by max_steps at an epoch's end: Lightning takes a batch more in it
        (dict(epochs=1), dict(epochs=3)),  # by epochs: Lightning gives the loader no state, the sampler its epoch
    ],
)
def test_one_process_runs_resumed_at_any_point_see_the_batches_of_the_run_that_never_stopped(tmp_path, first, then):
    quiet_lightning()
    whole = fit_one(tmp_path / "whole", **then)
    part = fit_one(tmp_path / "first", **first)
    rest = fit_one(tmp_path / "rest", **then, resume=str(tmp_path / "first" / "last.ckpt"))
    assert part + rest == whole


def test_resume_hint_in_both_syntaxes(tmp_path):
    stop = StopAndSave(dirpath=tmp_path / "run" / "checkpoints")
    assert stop.resume_hint() is None  # nothing saved yet
    stop.last_saved = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert stop.resume_hint() == f"trainer.fit(model, ckpt_path={str(stop.last_saved)!r})"
    assert stop.resume_hint(python=False) == f"commsched-train resume={tmp_path / 'run'} (and the same options)"
    assert StopAndSave(command_line=True).resume_hint() is None


class LastAtEpochStart(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.steps = path, []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.path.is_file():
            self.steps.append(torch.load(self.path, weights_only=False)["global_step"])


def test_an_epoch_end_saves_last_even_with_a_step_cadence(tmp_path):
    """ModelCheckpoint(save_last=True) writes `last` only beside a save of its own: with a cadence of
    100 steps, nothing in 30; StopAndSave writes it through it at every epoch end."""
    quiet_lightning()
    seen = LastAtEpochStart(tmp_path / "last.ckpt")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=30,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[
            ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=100),
            StopAndSave(),
            seen,
        ],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), ResumableDataLoader(Counted(48), batch_size=4, shuffle=True))
    assert seen.steps == [12, 24]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 30


class Reloaded(Net):
    def train_dataloader(self):
        return ResumableDataLoader(Counted(48), batch_size=4, shuffle=True)


def seen_over_epochs(reload: int) -> list[list[int]]:
    pl.seed_everything(5, verbose=False)
    model = Reloaded()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        reload_dataloaders_every_n_epochs=reload,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return model.seen


def test_a_loader_lightning_makes_anew_every_epoch_follows_the_epochs():
    """A new loader numbers its first pass by the epoch Lightning gave its sampler: the same shuffles
    as one loader for the whole fit, a new one every epoch."""
    quiet_lightning()
    once, anew = seen_over_epochs(0), seen_over_epochs(1)
    epochs = [once[i : i + 12] for i in (0, 12, 24)]
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert anew == once


@pytest.mark.parametrize("case", ["topk", "streams"])
def test_a_checkpoint_saved_after_fit_keeps_the_communication_state(tmp_path, case):
    """`trainer.save_checkpoint` after `fit` returned (as Lightning's docs save by hand) holds the
    same communication state as ModelCheckpoint's save at the same step: top-k's residuals, the
    plan and the streams search are not lost once the fit is over. Both load with weights_only=True."""
    proc = run_worker("run_save_after_fit.py", str(tmp_path), case)
    assert proc.returncode == 0, proc.stderr[-4000:]
    manual, last = (
        _with_parts(tmp_path / case / name, torch.load(tmp_path / case / name, weights_only=True))
        for name in ("manual.ckpt", "ckpt/last.ckpt")
    )
    assert manual["global_step"] == last["global_step"]
    assert "commsched" in manual, "the checkpoint saved after fit has no communication state"
    assert manual["commsched"].keys() == last["commsched"].keys()
    diff, key = max_abs_diff(_tensors(manual["commsched"]), _tensors(last["commsched"]))
    assert diff == 0.0, f"{key} differs by {diff:.3g}"
    assert _plain(manual["commsched"]) == _plain(last["commsched"])
    if case == "topk":
        assert _tensors(manual["commsched"]), "top-k kept no residuals"


def _with_parts(path, checkpoint: dict) -> dict:
    """The checkpoint with each rank's part, written beside it, in place of where the parts are."""
    entry = dict(checkpoint.get("commsched", {}))
    parts = entry.pop("per_rank_parts", None)
    if parts is not None:
        folder = path.parent / parts["folder"]
        entry["per_rank"] = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(parts["world_size"])]
    return {**checkpoint, "commsched": entry} if "commsched" in checkpoint else checkpoint


def _tensors(entry, prefix: str = "") -> dict:
    if isinstance(entry, torch.Tensor):
        return {prefix: entry}
    items = entry.items() if isinstance(entry, dict) else enumerate(entry) if isinstance(entry, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def _plain(entry):
    """Everything but the tensors: plans, choices, counters."""
    if isinstance(entry, torch.Tensor):
        return "tensor"
    if isinstance(entry, dict):
        return {k: _plain(v) for k, v in entry.items()}
    if isinstance(entry, (list, tuple)):
        return [_plain(v) for v in entry]
    return entry
