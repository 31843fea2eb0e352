"""The soak: 2,000 steps of DeAR and of WFBP on 4 streams, with random per-rank delays at four points
of every step; the replicas' weights, checksummed every 100 steps, never differ, and the run ends on
the model Lightning's ddp trains under the same delays."""

from __future__ import annotations

import pytest
import torch

from conftest import max_abs_diff, run_worker

STEPS = 2000


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")

    def load(schedule: str) -> list[dict]:
        if not (out / f"{schedule}.rank0.pt").exists():
            proc = run_worker("run_soak.py", schedule, str(STEPS), str(out), timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
        return [torch.load(out / f"{schedule}.rank{r}.pt", weights_only=False) for r in range(2)]

    return load


@pytest.mark.parametrize("schedule", ["dear", "streams"])
def test_replicas_never_drift_apart_over_a_long_run_with_random_delays(soaked, schedule):
    ranks = soaked(schedule)
    assert all(r["steps"] == STEPS for r in ranks)
    assert sorted(ranks[0]["sums"]) == list(range(100, STEPS + 1, 100))
    differing = [step for step, digest in ranks[0]["sums"].items() if ranks[1]["sums"][step] != digest]
    assert not differing, f"{schedule}: the replicas differ at steps {differing}"
    diff, key = max_abs_diff(ranks[0]["final"], soaked("ddp")[0]["final"])
    assert diff <= 1e-5, f"{schedule} after {STEPS} steps: {key} differs from ddp by {diff:.3g}"
