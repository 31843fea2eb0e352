"""commsched.optim.LARS: Eq. 11 of [Cloud-TopK] against a hand-written step, and its parallel norms
equal to the norms computed whole, in real 2-process wfbp runs; refused where steps are split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commsched.optim import LARS
from conftest import max_abs_diff, run_worker


def test_one_lars_step_is_eq_11_with_momentum_and_weight_decay():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.weight.grad, layer.bias.grad = torch.randn(3, 4), torch.randn(3)
    g_w, g_b = layer.weight.grad.clone(), layer.bias.grad.clone()
    LARS(
        layer.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, parallel_norms=False
    ).step()
    trust = 0.02 * weight.norm() / (g_w.norm() + 0.01 * weight.norm())
    assert torch.allclose(layer.weight, weight - 0.5 * trust * (g_w + 0.01 * weight), atol=1e-7)
    assert torch.allclose(layer.bias, bias - 0.5 * (g_b + 0.01 * bias), atol=1e-7)  # 1-d: the global rate


def test_bad_lars_settings_name_the_field():
    from commsched import CommSchedConfigError

    with pytest.raises(CommSchedConfigError, match="LARS.trust_coefficient"):
        LARS(nn.Linear(2, 2).parameters(), lr=0.1, trust_coefficient=0)


@pytest.fixture(scope="module")
def lars_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lars")
    proc = run_worker("run_lars.py", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return lambda name, rank=0: torch.load(out / f"{name}.rank{rank}.pt", weights_only=False)


def test_parallel_norms_equal_norms_computed_whole(lars_runs):
    whole, parallel = lars_runs("whole"), lars_runs("parallel")
    assert max_abs_diff(whole["state"], parallel["state"])[0] <= 1e-6
    assert max_abs_diff(whole["state"], whole["initial"])[0] > 1e-3
    assert max_abs_diff(parallel["state"], lars_runs("parallel", 1)["state"])[0] == 0.0
    assert parallel["norm_collectives"] > 0 and whole["norm_collectives"] == 0


def test_lars_with_parallel_norms_is_refused_where_steps_are_split(lars_runs):
    assert "LARS(parallel_norms=True)" in lars_runs("refused-dear")["refused"]
