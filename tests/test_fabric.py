"""Fabric's hand-written loops under commsched's strategies (workers/run_fabric.py, 2 processes): Hugging
Face's GPT-2 with AdamW, accumulation under `fabric.no_backward_sync`, `fabric.clip_gradients`, evaluation
forwards; each exact schedule trains the model Fabric's ddp trains, and a run saved with `fabric.save`,
ended, and loaded with `fabric.load` in a new run ends where the uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch

from conftest import max_abs_diff, run_worker

EXACT = ["wfbp", "dear", "deft", "dear-bayes", "deft-undelayed"]
RESUMED = ["dear", "deft", "topk"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric")
    first = ["ddp", *EXACT, "topk", "ddp-fp16", "dear-fp16", "ddp-compiled", "dear-compiled"]
    first += [f"{s}-first" for s in RESUMED]
    for cases in (first, [f"{s}-resumed" for s in RESUMED]):  # the second run is a new pair of processes
        proc = run_worker("run_fabric.py", str(out), *cases)
        if proc.returncode != 0:
            pytest.fail(f"runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    load = lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.out = out
    return load


@pytest.mark.parametrize("schedule", EXACT)
def test_trains_the_model_fabric_ddp_trains(runs, schedule):
    for rank in (0, 1):
        reference, got = runs("ddp", rank), runs(schedule, rank)
        diff, where = max_abs_diff(got["state"], reference["state"])
        assert diff <= 1e-5, f"{schedule}, rank {rank}: {diff:.2e} from Fabric's ddp at {where}"
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5), "fabric.clip_gradients' norms differ"
        assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert {name for name, _ in runs(schedule)["ran"]} <= {schedule.split("-")[0], "wfbp", "dear"}  # deft hands on


def test_the_loop_goes_through_rebuilds_and_hand_overs_inside_no_backward_sync(runs):
    """The batch starts at the first micro-batch's forward, inside `no_backward_sync`: a search's layouts
    and DeFT's hand-over to DeAR change what runs there, and the results above hold through them."""
    assert len({buckets for _, buckets in runs("dear-bayes")["ran"]}) > 1, runs("dear-bayes")["ran"]
    assert {name for name, _ in runs("deft-undelayed")["ran"]} == {"deft", "dear"}, runs("deft-undelayed")["ran"]


def test_the_reference_trains_and_clips(runs):
    """A test comparing models that never moved, or gradients never clipped, could not fail."""
    reference = runs("ddp")
    assert reference["moved"] > 1e-3
    assert max(reference["norms"]) > 0.5  # clipping changed the step


def test_fp16_scaler_skips_and_unscales_before_clipping_as_under_ddp(runs):
    assert min(runs("ddp-fp16")["scales"]) < 2.0**22, "no step was skipped: the scaler's skip path is untested"
    for rank in (0, 1):
        reference, got = runs("ddp-fp16", rank), runs("dear-fp16", rank)
        assert got["scales"] == reference["scales"]
        diff, where = max_abs_diff(got["state"], reference["state"])
        assert diff <= 1e-5, f"dear-fp16, rank {rank}: {diff:.2e} from ddp at {where}"


def test_a_model_given_compiled_trains_as_under_ddp_compiled(runs):
    """`fabric.setup(torch.compile(model))`: Fabric compiles the strategy's wrapper; the schedule learns it at
    the first traced forward and runs as under compile (updates applied before the compiled region)."""
    for rank in (0, 1):
        diff, where = max_abs_diff(runs("dear-compiled", rank)["state"], runs("ddp-compiled", rank)["state"])
        assert diff <= 1e-5, f"compiled dear, rank {rank}: {diff:.2e} from compiled ddp at {where}"


@pytest.mark.parametrize("schedule", RESUMED)
def test_save_end_load_equals_the_uninterrupted_run(runs, schedule):
    for rank in (0, 1):
        diff, where = max_abs_diff(runs(f"{schedule}-resumed", rank)["state"], runs(schedule, rank)["state"])
        assert diff <= 1e-6, f"{schedule} resumed, rank {rank}: {diff:.2e} from the uninterrupted run at {where}"


def test_the_checkpoint_holds_each_ranks_residuals(runs):
    """top-k's error feedback is what a resume must not lose: each rank wrote its residuals beside the
    checkpoint, and they are not zero (so the resume test above would fail without them)."""
    saved = torch.load(runs.out / "topk.ckpt", weights_only=False)["commsched"]
    where = saved["per_rank_parts"]
    assert saved["per_rank"] is None and where["world_size"] == 2 and where["folder"].startswith("topk.ckpt.commsched/")
    parts = [torch.load(runs.out / where["folder"] / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    residuals = [rank["reducers"]["residual"] for rank in parts]
    assert len(residuals) == 2
    assert all(sum(t.abs().sum() for t in r.values()) > 0 for r in residuals)
    diff, _ = max_abs_diff(runs("topk")["state"], runs("ddp")["state"])
    assert diff > 1e-4, "top-k sent everything: its residuals were never used"
