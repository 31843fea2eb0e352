"""wfbp and dear are exact re-orderings of synchronous SGD: after >= 12 optimizer steps their weights
equal Lightning `ddp`'s (find_unused_parameters=True) within 1e-5, on the toy model of
workers/toy.py (conv + BatchNorm + linear + embedding, tied weight, frozen layer, a branch unused
on some steps, parameters read outside module forwards), with a per-step LR scheduler,
accumulation 2, gradient clipping and mid-epoch validation."""

from __future__ import annotations

import pytest
import torch

from conftest import max_abs_diff, per_link

TOLERANCE = 1e-5


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("schedule", ["wfbp", "dear"])
def test_final_weights_equal_ddp(cases, world, optimizer, schedule):
    results = cases(world)
    reference = results.load(f"ddp-{optimizer}")
    assert reference["global_step"] >= 12
    for rank, result in enumerate(results.all_ranks(f"{schedule}-{optimizer}")):
        assert result["global_step"] == reference["global_step"]
        diff, key = max_abs_diff(result["state"], reference["state"])
        assert diff <= TOLERANCE, f"rank {rank}: {key} differs from ddp by {diff:.3g}"


@pytest.mark.parametrize("world", [2, 3])
def test_a_schedule_over_sub_group_links_equals_ddp(cases, world):
    """workers/extension_schedule.py's "hier": three stages per bucket over the intra- and inter-node
    links, each requested after the one before."""
    results = cases(world)
    reference = results.load("ddp-sgd")
    for rank, result in enumerate(results.all_ranks("hier-sgd")):
        diff, key = max_abs_diff(result["state"], reference["state"])
        assert diff <= TOLERANCE, f"rank {rank}: {key} differs from ddp by {diff:.3g}"
        assert {"intra", "inter"} <= {record[0] for record in result["trace"]}


@pytest.mark.parametrize(
    "case, reference",
    [
        ("wfbp-value", "ddp-value"),  # clipping by value
        ("dear-value", "ddp-value"),
        ("dear-layers", "ddp-sgd"),  # N-layers fusion: grouping never changes the math
        ("dear-onebucket", "ddp-sgd"),  # everything in one bucket
        ("dear-profiled", "ddp-sgd"),  # profiling (and its flush, isolated timings, link probe) changes nothing
    ],
)
def test_variants_equal_ddp(cases, case, reference):
    results = cases(2)
    diff, key = max_abs_diff(results.load(case)["state"], results.load(reference)["state"])
    assert diff <= TOLERANCE, f"{case}: {key} differs from {reference} by {diff:.3g}"


def test_bf16_mixed_equals_ddp(cases):
    results = cases(2)
    diff, key = max_abs_diff(results.load("dear-bf16")["state"], results.load("ddp-bf16")["state"])
    assert diff <= TOLERANCE, f"{key} differs by {diff:.3g}"


@pytest.mark.parametrize(
    "case, reference",
    [
        ("wfbp-fp16", "ddp-fp16"),
        ("dear-fp16", "ddp-fp16"),
        ("deft-fp16", "ddp-fp16"),
        ("dear-fp16-value", "ddp-fp16-value"),
        ("dear-fp16-rank0-reads", "ddp-fp16"),  # rank 0 alone makes its gradients whole after backward
    ],
)
def test_fp16_with_a_grad_scaler_equals_ddp_skipped_steps_included(cases, case, reference):
    """Lightning's "16-mixed" (fp16 autocast, torch's GradScaler) with a first scale the toy's gradients
    overflow: the same steps are skipped and the same scale kept as under ddp, on every rank, and the
    weights are ddp's. DeAR unscales and checks its shards, DeFT steps each iteration's generation whole."""
    results = cases(2)
    expected = results.load(reference)
    assert expected["scale"] < 2.0**22, "no step was skipped: the case tests nothing"
    for rank, result in enumerate(results.all_ranks(case)):
        assert result["scale"] == expected["scale"], f"rank {rank} skipped other steps than ddp"
        diff, key = max_abs_diff(result["state"], expected["state"])
        assert diff <= TOLERANCE, f"{case} rank {rank}: {key} differs from {reference} by {diff:.3g}"


@pytest.mark.parametrize(
    "case, reference, tolerance",
    [
        ("wfbp-bf16wire", "ddp-bf16hook", 1e-6),
        ("wfbp-bf16hook", "ddp-bf16hook", 1e-6),  # torch's hook given to commsched: read as comm_dtype="bf16"
        ("dear-bf16wire-unclipped", "ddp-bf16hook-unclipped", 0.0),
        ("dear-bf16wire-streams-unclipped", "ddp-bf16hook-unclipped", 0.0),
        ("dear-bf16wire", "ddp-bf16hook", TOLERANCE),
        ("dear-bf16wire-streams", "ddp-bf16hook", TOLERANCE),
        ("deft-bf16wire", "ddp-bf16hook", 1e-6),
        ("wfbp-fp16wire", "ddp-fp16hook", 1e-6),
        ("dear-fp16wire-unclipped", "ddp-fp16hook-unclipped", 1e-6),
        ("dear-fp16wire", "ddp-fp16hook", TOLERANCE),
    ],
)
def test_a_low_precision_wire_equals_ddps_compress_hook(cases, case, reference, tolerance):
    """comm_dtype="bf16" / "fp16": every collective of gradients carries 16-bit values, averaged as torch's
    compress hooks average them, so the run is DDP's with that hook (on 2 processes the division by 2 and
    the sum of two are exact in any order: bf16 unclipped under dear is DDP's bit for bit), and far from
    fp32's. Clipped by norm, dear takes the norm from its shards, which can differ from torch's in the
    last bit (as in fp32); the clipped gradients feed the next step's, and a 16-bit wire can round such a
    difference into a whole 16-bit step of one value: 2e-6 after 12 steps on one machine, 0 on another.
    fp16's subnormals make dividing before the cast (commsched) and after it (torch) differ slightly."""
    results = cases(2)
    expected = results.load(reference)
    fp32 = results.load("ddp-sgd-unclipped" if reference.endswith("-unclipped") else "ddp-sgd")
    assert max_abs_diff(expected["state"], fp32["state"])[0] > TOLERANCE, "the hook did nothing"
    wire = "torch.bfloat16" if "bf16" in case else "torch.float16"
    for rank, result in enumerate(results.all_ranks(case)):
        sent = {dtype for link, op, tag, numel, dtype in result["trace"] if tag.startswith(("bucket", "g"))}
        assert sent == {wire}, f"{case} sent gradients as {sent}"
        finite = [k for k, v in result["state"].items() if v.is_floating_point() and not v.isfinite().all()]
        assert not finite, f"{case} rank {rank}: {finite} not finite (a difference of NaN would read as none)"
        diff, key = max_abs_diff(result["state"], expected["state"])
        assert diff <= tolerance, f"{case} rank {rank}: {key} differs from {reference} by {diff:.3g}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("schedule", ["wfbp", "dear"])
def test_parameters_identical_on_every_rank(cases, world, schedule):
    ranks = cases(world).all_ranks(f"{schedule}-sgd")
    for rank, result in enumerate(ranks[1:], start=1):
        for name, tensor in result["state"].items():
            if "running" not in name and "num_batches" not in name:  # buffers differ per rank, as under DDP
                assert torch.equal(tensor, ranks[0]["state"][name]), f"rank {rank} {name}"


def test_validate_test_predict_equal_ddp(cases):
    results = cases(2)
    dear, ddp = results.load("dear-eval"), results.load("ddp-eval")
    assert dear["validate_before_fit"][0]["val_loss"] == pytest.approx(
        ddp["validate_before_fit"][0]["val_loss"], abs=1e-6
    )
    assert dear["test"][0]["test_loss"] == pytest.approx(ddp["test"][0]["test_loss"], abs=1e-5)
    assert torch.allclose(dear["predict"], ddp["predict"], atol=1e-5)


@pytest.mark.parametrize(
    "case, reference",
    [
        ("dear-resume", "dear-2ep"),  # interrupted after epoch 1 and resumed == uninterrupted
        ("dear-2ep", "ddp-2ep"),
        ("wfbp-2ep", "ddp-2ep"),
        ("ddp-from-dear", "ddp-2ep"),  # a dear checkpoint resumes in plain ddp
        ("dear-from-ddp", "ddp-2ep"),  # and a ddp checkpoint in dear / wfbp
        ("wfbp-from-ddp", "ddp-2ep"),
    ],
)
def test_checkpoint_resume(cases, case, reference):
    results = cases(3)
    result, expected = results.load(case), results.load(reference)
    assert result["global_step"] == expected["global_step"] == 24
    diff, key = max_abs_diff(result["state"], expected["state"])
    assert diff <= TOLERANCE, f"{case}: {key} differs from {reference} by {diff:.3g}"


def test_unfreezing_mid_run_rebuilds_buckets_on_every_rank(cases):
    """The frozen layer becomes trainable at step 6: it must be averaged like every other parameter
    from then on (identical on all ranks), and dear must still equal wfbp."""
    results = cases(3)
    dear, wfbp, never = results.all_ranks("dear-unfreeze"), results.all_ranks("wfbp-unfreeze"), results.load("ddp-sgd")
    assert not torch.equal(dear[0]["state"]["frozen.weight"], never["state"]["frozen.weight"]), "layer never trained"
    for rank in range(results.world):
        assert torch.equal(dear[rank]["state"]["frozen.weight"], dear[0]["state"]["frozen.weight"])
        diff, key = max_abs_diff(dear[rank]["state"], wfbp[rank]["state"])
        assert diff <= TOLERANCE, f"rank {rank}: {key} differs by {diff:.3g}"


def test_profiling_reports_the_same_link_fit_on_every_rank(cases):
    """The probe is decided by rank 0 and its fit broadcast: a planner reading it decides alike everywhere."""
    profiles = [r["profile"] for r in cases(2).all_ranks("dear-profiled")]
    assert profiles[0]["link"] == profiles[1]["link"]
    assert set(profiles[0]["link"]) == {"workers", "all_reduce", "reduce_scatter", "all_gather"}
    assert profiles[0]["profiled_steps"] == 5 and len(profiles[0]["buckets"]) == len(profiles[1]["buckets"]) > 1


def test_a_link_bound_to_a_network_interface_changes_nothing(cases):
    results = cases(2)
    diff, key = max_abs_diff(results.load("dear-iface")["state"], results.load("ddp-sgd")["state"])
    assert diff <= TOLERANCE, f"{key} differs from ddp by {diff:.3g}"


def test_dear_handing_its_iterations_to_wfbp_changes_no_math(cases):
    """DeAR's default fallback: DeAR and WFBP take turns on real steps (the iterations change hands
    each turn, DeAR's pending update applied first), then the faster runs the rest; every rank follows
    the same turns, and the run equals ddp's."""
    results = cases(3)
    runs, reference = results.all_ranks("dear-fallback-2ep"), results.load("ddp-2ep")
    for rank, result in enumerate(runs):
        assert result["global_step"] == reference["global_step"] == 24
        diff, key = max_abs_diff(result["state"], reference["state"])
        assert diff <= TOLERANCE, f"rank {rank}: {key} differs from ddp by {diff:.3g}"
    ops = [op for link, op, tag, *_ in runs[0]["trace"] if tag == "bucket0"]
    assert "all_reduce" in ops and "reduce_scatter" in ops  # both schedules ran
    assert all(per_link(r["trace"]) == per_link(runs[0]["trace"]) for r in runs)


def test_dears_choice_between_itself_and_wfbp_is_kept_across_a_resume(cases):
    """The checkpoint holds the verdict and where its later checks stand: the resumed epoch runs the
    kept schedule from its first step (no turns again) and counts on toward the next check."""
    results = cases(3)
    saved = [
        torch.load(results.directory / f"{case}-ckpt" / "last.ckpt", weights_only=False)["commsched"]["shared"][
            "choices"
        ]["fallback"]
        for case in ("dear-fallback-1ep", "dear-fallback-resume")
    ]
    first, resumed = saved
    assert first["verdict"] is not None and resumed["verdict"] == first["verdict"]  # not decided again
    assert (
        resumed["rechecks"]["iterations"] == first["rechecks"]["iterations"] + 12
    )  # the resumed epoch's 12 steps counted on
    kept = (
        {"reduce_scatter", "all_gather"} if first["verdict"]["keep"] else {"all_reduce"}
    )  # DeAR's two halves, or WFBP's one
    for rank, result in enumerate(results.all_ranks("dear-fallback-resume")):
        assert {op for link, op, tag, *_ in result["trace"] if tag == "bucket0"} == kept, (
            f"rank {rank}: turns taken again"
        )
        diff, key = max_abs_diff(result["state"], results.load("ddp-2ep", rank)["state"])
        assert diff <= TOLERANCE, f"rank {rank}: {key} differs from ddp by {diff:.3g}"


@pytest.mark.parametrize("case", ["dear-auto-fallback", "dear-auto-fallback-fixed"])
def test_wfbps_turns_run_on_the_layout_wfbps_own_planner_makes(cases, case):
    """Under the default fusion DeAR's buckets are planned for DeAR's two halves; when DeAR hands its
    iterations to WFBP, WFBP runs on the layout MG-WFBP's programme makes from the same profile where
    DeAR's own plan measured faster than fixed buckets, and on fixed buckets where it did not (the
    model did not hold on this run) or where MG-WFBP predicts no gain; the math is ddp's either way."""
    from commsched.planning.model_plans import plan_from_profile

    results = cases(3)
    runs = results.all_ranks(case)
    first = runs[0]
    planned = plan_from_profile(first["profile"], "mgwfbp", fixed_cap_bytes=600)
    wfbp_layouts = [buckets for name, buckets in first["ran"] if name == "wfbp"]
    dear_layouts = [buckets for name, buckets in first["ran"] if name == "dear"]
    assert wfbp_layouts, f"WFBP never ran: {first['ran']}"
    own_plan_kept = first["fusion_plan"]["details"].get("auto", {}).get("kept") == "planned"  # none: plan = fixed
    assert case != "dear-auto-fallback-fixed" or not own_plan_kept, "the planned layout's turns were made slower"
    if own_plan_kept and planned.predicted_s < planned.details["fixed_predicted_s"]:
        expected = planned.buckets
    else:
        expected = dear_layouts[0]  # fixed buckets: the layout every run starts on
    if expected is dear_layouts[0]:
        assert all(layout == expected for layout in wfbp_layouts), f"WFBP ran on {wfbp_layouts}, not {expected}"
    bucket_of = {name: b for b, names in enumerate(expected) for name in names}
    for layout in wfbp_layouts:  # the layout cut into runs of the order gradients become ready in, as every plan is
        assert sorted(n for bucket in layout for n in bucket) == sorted(bucket_of), (
            f"WFBP's buckets {layout} miss parameters"
        )
        assert all(len({bucket_of[n] for n in bucket}) == 1 for bucket in layout), (
            f"WFBP ran on {layout}, not {expected}"
        )
    for rank, result in enumerate(runs):
        assert result["ran"] == first["ran"], f"rank {rank} ran other schedules or buckets"
        diff, key = max_abs_diff(result["state"], results.load("ddp-2ep", rank)["state"])
        assert diff <= TOLERANCE, f"rank {rank}: {key} differs from ddp by {diff:.3g}"
