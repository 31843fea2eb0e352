"""Which optimizers DeAR may step bucket by bucket: the known classes pass the split-against-whole
check, the optimizers that read a whole group in their step (from the real packages) fail it, a
declared class is checked before it is trusted, and the hyper-parameters of a deferred step come
back as a scheduler left them while group-level state the step wrote is kept."""

from __future__ import annotations

import importlib

import pytest
import torch
from dadaptation import DAdaptAdam
from lion_pytorch import Lion
from prodigyopt import Prodigy
from schedulefree import SGDScheduleFree

from commsched.errors import CommSchedConfigError
from commsched.schedules.deferred_step import snapshot_hyperparams
from commsched.schedules.optimizer_step import (
    KNOWN_PER_PARAMETER,
    check_splits_exactly,
    per_parameter_classes,
    step_mode,
    step_with,
)


def _class(name: str) -> type:
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def _groups(cls: type, **settings) -> list[dict]:
    optimizer = cls([torch.nn.Parameter(torch.zeros(2))], **settings)
    if hasattr(optimizer, "train"):
        optimizer.train()  # schedule-free steps in train mode only
    return optimizer.param_groups


@pytest.mark.parametrize("name", sorted(KNOWN_PER_PARAMETER))
def test_every_known_class_steps_each_parameter_alone(name):
    cls = _class(name)
    settings = {"momentum": 0.9, "weight_decay": 1e-2} if cls is torch.optim.SGD else {}
    check_splits_exactly(cls, _groups(cls, lr=0.01, **settings))


@pytest.mark.parametrize("cls", [Prodigy, DAdaptAdam, SGDScheduleFree])
def test_optimizers_that_read_the_whole_group_are_caught(cls):
    with pytest.raises(CommSchedConfigError, match="does not step each parameter alone"):
        check_splits_exactly(cls, _groups(cls, lr=1.0 if cls is not SGDScheduleFree else 0.05))


def test_the_mode_by_class():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert step_mode(torch.optim.AdamW(params), ()).split
    assert step_mode(Lion(params), ()).split
    assert not step_mode(Prodigy(params), ()).split

    class MySGD(torch.optim.SGD):  # a subclass may change the step: not trusted by its base class
        pass

    assert not step_mode(MySGD(params, lr=0.1), ()).split
    assert step_mode(MySGD(params, lr=0.1), (MySGD,)).split  # declared, and the check passes
    with pytest.raises(CommSchedConfigError, match="prodigyopt.prodigy.Prodigy does not step each parameter alone"):
        step_mode(Prodigy(params), tuple(per_parameter_classes(["prodigyopt.Prodigy"])))


def test_a_declared_name_must_be_an_optimizer_class():
    with pytest.raises(CommSchedConfigError, match="not an importable class"):
        per_parameter_classes(["prodigyopt.NoSuchThing"])
    with pytest.raises(CommSchedConfigError, match="not a torch.optim.Optimizer subclass"):
        per_parameter_classes(["torch.nn.Linear"])


def test_a_deferred_step_uses_its_own_hyperparameters_and_keeps_what_it_wrote():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.5)
    optimizer.param_groups[0].update(d=1.0, count=torch.zeros(()), scale=torch.ones(()))
    hyper = snapshot_hyperparams(optimizer)  # as DeAR takes it when the step is due (tensors cloned)
    optimizer.param_groups[0]["lr"] = 0.25  # a scheduler stepped after the step was due
    seen = []

    def step() -> None:
        group = optimizer.param_groups[0]
        seen.append(group["lr"])
        group["d"] = group["d"] * 2  # group-level state, as Prodigy's d
        group["count"].add_(1)  # group-level state changed in place

    written = step_with(optimizer, hyper, step)
    assert seen == [0.5] and written == {"d", "count"}
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.25 and group["d"] == 2.0 and float(group["count"]) == 1.0
    assert (
        float(group["scale"]) == 1.0 and group["scale"] is not hyper[0]["scale"]
    )  # untouched: the run's own tensor back
