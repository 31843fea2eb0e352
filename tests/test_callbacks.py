"""Exact under Lightning's own callbacks: every callback or module hook that reads or changes weights,
buffers or optimizer state, stops the fit, changes how many micro-batches make a step or sweeps the
learning rate sees and produces what it would under `ddp` (<= 1e-5, fp32), on a
third-party model (a RegNet from `transformers`) and on the project's own ResNet. Where `ddp`
itself lets replicas diverge (BackboneFinetuning), every schedule keeps them identical and equal
to a correct synchronous run (`wfbp`)."""

from __future__ import annotations

import pytest
import torch

from conftest import max_abs_diff, run_worker

TOLERANCE = 1e-5
FULL_FIT_STEPS = 24  # run_callbacks.py: 4 epochs of 6 steps
INITIAL_LR = 0.05  # callback_models.Classifier's
CALLBACKS = ["ema", "swa", "pruning", "reader", "ckpt1", "ckpt2", "ckpt3", "early", "accum", "lrfind", "lrmon"]
OWN_MODEL_CALLBACKS = ["ema", "swa", "pruning", "reader"]
DEFT_CALLBACKS = [
    "ema",
    "swa",
    "pruning",
    "reader",
    "ckpt2",
    "early",
    "accum",
    "lrfind",
]  # deft with room for everything: DDP's updates
CASES = [
    *(f"regnet-{cb}-{s}" for cb in [*CALLBACKS, "finetune"] for s in ("ddp", "wfbp", "dear")),
    *(f"regnet-{cb}-deft" for cb in [*DEFT_CALLBACKS, "finetune"]),
    *(f"resnet-{cb}-{s}" for cb in [*OWN_MODEL_CALLBACKS, "finetune"] for s in ("ddp", "wfbp", "dear")),
]


class Results:
    def __init__(self, directory) -> None:
        self.directory = directory

    def load(self, case: str, rank: int = 0) -> dict:
        return torch.load(self.directory / f"{case}.rank{rank}.pt", weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Results:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("callbacks")
    proc = run_worker("run_callbacks.py", str(out), "2", *CASES)
    if proc.returncode != 0:
        pytest.fail(f"callback runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return Results(out)


def _weights(state: dict) -> dict:
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


@pytest.mark.parametrize(
    "case, schedule",
    [
        *(
            (f"{arch}-{cb}", s)
            for s in ("wfbp", "dear")
            for arch, cbs in (("regnet", CALLBACKS), ("resnet", OWN_MODEL_CALLBACKS))
            for cb in cbs
        ),
        *((f"regnet-{cb}", "deft") for cb in DEFT_CALLBACKS),
    ],
)
def test_callback_sees_and_produces_what_it_would_under_ddp(results, case, schedule):
    reference = results.load(f"{case}-ddp")
    for rank in (0, 1):
        result = results.load(f"{case}-{schedule}", rank)
        assert result["global_step"] == reference["global_step"]
        diff, key = max_abs_diff(result["state"], reference["state"])
        assert diff <= TOLERANCE, f"rank {rank}: weight {key} differs from ddp by {diff:.3g}"
        diff, key = max_abs_diff(result["optimizer"], reference["optimizer"])
        assert diff <= TOLERANCE, f"rank {rank}: optimizer state {key} differs from ddp by {diff:.3g}"
    result = results.load(f"{case}-{schedule}")
    if case.endswith("reader"):  # the module's own on_train_batch_end saw the weights ddp's saw, every step
        seen, expected = result["weights_seen"], reference["weights_seen"]
        assert len(seen) == len(expected) == reference["global_step"]
        assert max((a - b).abs().max().item() for a, b in zip(seen, expected)) <= TOLERANCE
    if case.endswith(("early", "accum")):  # fewer steps than the full fit: the callback acted, alike on both
        assert reference["global_step"] < FULL_FIT_STEPS
    if case.endswith("lrfind"):  # the sweep's suggestion (from its losses) is ddp's, and was taken
        assert result["lr"] == reference["lr"] != INITIAL_LR
    if case.endswith("ema"):  # the averaged model, built in on_train_batch_end
        diff, key = max_abs_diff(result["average"], reference["average"])
        assert diff <= TOLERANCE, f"EMA average {key} differs from ddp by {diff:.3g}"


@pytest.mark.parametrize("arch", ["regnet", "resnet"])
def test_unfrozen_backbone_is_synchronised_on_every_rank(results, arch):
    """BackboneFinetuning unfreezes the backbone at epoch 1: every schedule rebuilds its buckets and
    keeps the replicas identical; dear equals the synchronous wfbp run."""
    for schedule in ("wfbp", "dear", "deft") if arch == "regnet" else ("wfbp", "dear"):
        ranks = [results.load(f"{arch}-finetune-{schedule}", r) for r in (0, 1)]
        diff, key = max_abs_diff(_weights(ranks[0]["state"]), _weights(ranks[1]["state"]))
        assert diff == 0.0, f"{schedule}: replicas differ at {key} by {diff:.3g}"
    diff, key = max_abs_diff(
        results.load(f"{arch}-finetune-dear")["state"], results.load(f"{arch}-finetune-wfbp")["state"]
    )
    assert diff <= TOLERANCE, f"dear differs from wfbp at {key} by {diff:.3g}"
    if arch == "regnet":
        diff, key = max_abs_diff(
            results.load("regnet-finetune-deft")["state"], results.load("regnet-finetune-wfbp")["state"]
        )
        assert diff <= TOLERANCE, f"deft differs from wfbp at {key} by {diff:.3g}"
    dear = results.load(f"{arch}-finetune-dear")  # the backbone did train once unfrozen
    backbone = [k for k in dear["initial"] if k.startswith("backbone.") and k.endswith("weight")]
    assert any(not torch.equal(dear["state"][k], dear["initial"][k]) for k in backbone)


def test_checkpoint_callback_saves_the_weights_ddp_saves(results, tmp_path):
    """ModelCheckpoint every 3 steps under dear writes the same weights and optimizer state as under ddp."""
    from pathlib import Path

    dear_dir, ddp_dir = (
        Path(results.directory) / "regnet-ckpt3-dear-ckpt",
        Path(results.directory) / "regnet-ckpt3-ddp-ckpt",
    )
    names = sorted(p.name for p in dear_dir.glob("*.ckpt"))
    assert names and names == sorted(p.name for p in ddp_dir.glob("*.ckpt"))
    for name in names:
        dear = torch.load(dear_dir / name, weights_only=False)
        ddp = torch.load(ddp_dir / name, weights_only=False)
        diff, key = max_abs_diff(dear["state_dict"], ddp["state_dict"])
        assert diff <= TOLERANCE, f"{name}: {key} differs by {diff:.3g}"
        assert dear["commsched"]["schedule"] == "dear" and dear["commsched"]["world_size"] == 2
