"""torch.compile as Lightning's docs show it (`trainer.fit(torch.compile(model))`): every exact
schedule trains the model ddp trains, with no graph break of its own and no recompile after the
warm-up steps (a pending parameter's class never reaches the compiled code)."""

from __future__ import annotations

import pytest
import torch

from conftest import max_abs_diff, run_worker

SCHEDULES = ("dear", "wfbp")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled")
    proc = run_worker("run_compiled.py", str(out), "ddp", *SCHEDULES)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in ("ddp", *SCHEDULES)}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_compiled_model_trains_as_under_ddp(compiled, schedule):
    diff, key = max_abs_diff(compiled[schedule]["state"], compiled["ddp"]["state"])
    assert diff <= 1e-5, f"{schedule}: {key} differs from compiled ddp by {diff:.3g}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_graph_break_and_no_recompile_of_its_own(compiled, schedule):
    run, ddp = compiled[schedule], compiled["ddp"]
    assert run["graph_breaks"] == ddp["graph_breaks"], run["break_reasons"]
    assert run["graphs_at_end"] == run["graphs_after_warmup"] == ddp["graphs_at_end"], run
