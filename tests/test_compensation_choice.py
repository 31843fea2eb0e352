"""Which compensation "auto" runs for an optimizer, how late it was measured to keep accuracy, and the
Preserver accepting a one-step-stale plan on that evidence alone (no processes: plans solved from given
stage times)."""

from __future__ import annotations

import pytest
import torch

from commsched.deft.plan import Timings, plan_for
from commsched.deft.preserver import Preserver
from commsched.deft.spike_compensation import chosen_for, measured_staleness, resolve_compensation
from commsched.deft.stability import Stepper


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize(
    "make, chosen, late",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "spike+predict", 1),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.95, weight_decay=5e-4), "spike+predict", 1),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5), "none", 0),
        (lambda p: torch.optim.SGD(p, lr=0.1), "none", 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "none", 0),
        (
            lambda p: torch.optim.SGD([{"params": p[:1]}, {"params": p[1:], "momentum": 0.5}], lr=0.1, momentum=0.9),
            "none",
            0,
        ),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), "predict", 0),
        (lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.5, 0.999)), "none", 0),
        (lambda p: torch.optim.RMSprop(p, lr=1e-3), "none", 0),
    ],
)
def test_auto_picks_the_compensation_measured_for_the_optimizer(make, chosen, late):
    optimizer = make(_params())
    assert chosen_for(optimizer) == resolve_compensation("auto", optimizer) == chosen
    assert measured_staleness(chosen, optimizer) == late
    assert resolve_compensation("none", optimizer) == "none"
    assert measured_staleness("none", optimizer) == 0


STALE = Timings(0.01, [0.01, 0.01], [[0.02, 0.02], [0.04, 0.04]])
"""Stage times whose plan at capacity 1 steps each iteration's gradient one iteration late, K=[1]."""


def _choose(preserver: Preserver, compensation: str, measured: int):
    stats = {
        "loss": 1.0,
        "lr": 0.1,
        "mu": 1.0,
        "sigma": 1.0,
        "batch": 8,
        "curvature": None,
        "stepper": Stepper(0.1, 0.9),
        "compensation": compensation,
        "measured_staleness": measured,
    }
    return preserver.choose(
        lambda capacity: plan_for([1000, 1000], STALE, float("inf") if capacity is None else capacity), 1.0, stats
    )


def test_with_one_step_allowed_the_preserver_accepts_a_stale_plan_only_where_it_was_measured_to_keep_accuracy():
    assert plan_for([1000, 1000], STALE, 1.0).staleness == 1
    plan, decisions = _choose(Preserver(max_staleness=1), "spike+predict", 1)
    assert plan.staleness == 1 and len(decisions) == 1 and decisions[0]["accepted"]
    assert decisions[0]["compensation"] == "spike+predict"
    # the same plan uncompensated, or under an optimizer without the evidence: the capacity grows until nothing is late
    for compensation, measured in (("none", 0), ("predict", 0)):
        plan, decisions = _choose(Preserver(max_staleness=1), compensation, measured)
        assert plan.staleness == 0 and not decisions[0]["accepted"] and decisions[-1]["accepted"]
    # the default, max_staleness=0, refuses even the measured case
    plan, decisions = _choose(Preserver(), "spike+predict", 1)
    assert plan.staleness == 0 and not decisions[0]["accepted"]
