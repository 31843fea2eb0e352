"""Fabric loops over several modules or optimizers (workers/run_fabric_parts.py, 2 processes): the loop of
Lightning's Fabric DCGAN example (a generator and a discriminator set up apart, each with its Adam), an
encoder and a decoder stepped by one optimizer, one module stepped by two. Every schedule trains what
Fabric's ddp trains, sends what ddp sends (each module's gradients once per backward that reaches it), and
a run saved half way and loaded in a new run ends where the uninterrupted one does."""

from __future__ import annotations

import collections

import pytest
import torch

from conftest import assert_same_as_reference, run_worker

TOLERANCE = 1e-5
STEPS = 8  # run_fabric_parts.py
EXACT = {
    "dcgan": ["wfbp", "dear", "deft", "streams", "traced", "compiled"],
    "shared": ["wfbp", "dear", "deft"],
    "twoopts": ["wfbp", "dear", "deft"],
    "optfirst": ["dear"],
}
REFERENCE = {"optfirst": "twoopts"}  # the same loop, its optimizers set up first
RESUMED = ["dcgan-dear", "shared-dear"]
HANDED_OVER = "this Fabric loop steps several modules or optimizers by hand"
STEPPING_PART_BY_PART = ("dear", "deft", "streams", "traced", "compiled")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_parts")
    first = [f"{pattern}-{s}" for pattern, schedules in EXACT.items() for s in ["ddp", *schedules]]
    first += ["dcgan-topk", "teacher-dear", "tied-dear", *(f"{case}-first" for case in RESUMED)]
    said = []
    for cases in (first, [f"{case}-resumed" for case in RESUMED]):  # the second run is a new pair of processes
        proc = run_worker("run_fabric_parts.py", str(out), *cases)
        if proc.returncode != 0:
            pytest.fail(f"runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        said.append((proc.stdout + proc.stderr).count(HANDED_OVER))
    load = lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.said = said
    return load


@pytest.mark.parametrize("case", [f"{pattern}-{s}" for pattern, schedules in EXACT.items() for s in schedules])
def test_trains_what_fabric_ddp_trains(runs, case):
    pattern = case.split("-")[0]
    assert_same_as_reference(runs, case, f"{REFERENCE.get(pattern, pattern)}-ddp", TOLERANCE)
    assert runs(case)["ran"] == "wfbp", "several modules or optimizers: every iteration runs WFBP"


@pytest.mark.parametrize("case", RESUMED)
def test_loaded_half_way_in_a_new_run_ends_where_the_whole_run_ends(runs, case):
    assert_same_as_reference(runs, f"{case}-resumed", f"{case.split('-')[0]}-ddp", TOLERANCE)


def test_the_reference_trains(runs):
    """Equal to a model that never moved would prove nothing."""
    assert runs("dcgan-ddp")["moved"] > 1e-3
    steps = {k: v.item() for k, v in runs("dcgan-ddp")["optimizer"].items() if k.endswith(".step")}
    assert set(steps.values()) == {float(STEPS)}, steps


def test_each_module_is_sent_once_per_backward_that_reaches_it_as_ddp_sends_it(runs):
    """The discriminator's gradients go three times a step (real, detached fake, the generator's loss through
    it), the generator's once: the detached fake's backward never reaches it, and nothing is sent for it."""
    traces = [runs("dcgan-traced", rank)["trace"] for rank in (0, 1)]
    assert traces[0] == traces[1], "the ranks issued different collectives"
    sizes = runs("dcgan-traced")["sizes"]
    padded = {size + size % 2: name for name, size in sizes.items()}  # a bucket is padded to the world size
    sent = collections.Counter(padded.get(numel, numel) for _, _, tag, numel in traces[0] if tag.startswith("bucket"))
    assert sent == {"d": 3 * STEPS, "g": STEPS}, (sent, sizes)


def test_sparse_exchange_with_several_modules_is_refused_with_the_way_out(runs):
    message = runs("dcgan-topk")["refused"]
    assert "invalid compression" in message and "allowed here: 'none'" in message, message


def test_a_frozen_module_set_up_is_refused_with_the_way_out(runs):
    message = runs("teacher-dear")["refused"]
    assert "no parameter that requires a gradient" in message and "fabric.to_device(module)" in message, message


def test_modules_sharing_a_parameter_are_refused_with_the_way_out(runs):
    message = runs("tied-dear")["refused"]
    assert "shares 2 parameter(s) (e.g. '1.weight')" in message and "Set up one module holding both" in message


def test_the_hand_over_is_said_once_a_run(runs):
    """Once per run, by one rank, whatever the number of modules: not once per module or per rank."""
    first = sum(s in STEPPING_PART_BY_PART for schedules in EXACT.values() for s in schedules) + len(RESUMED)
    assert runs.said == [first, len(RESUMED)]
