"""Files commsched reads and writes hold numbers only where numbers make sense: a plan file or a DeFT
timings file with NaN, Infinity (which Python's json reads though they are not JSON), an
overflowing 1e999 or a negative time is refused in one line that names the file's setting, the key
and the value; and what a run writes (metrics.json, summary.json) is strict JSON even where a figure
is missing, as in a resumed run with no step left to time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from commsched.errors import CommSchedConfigError
from commsched.planning.plan_file import SavedPlan

BIN = Path(sys.executable).parent
QUIET = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
TINY = [
    "model=small_cnn",
    "model.width=4",
    "data.train_size=32",
    "data.val_size=8",
    "data.batch_size=4",
    "warmup_steps=0",
    "trainer.limit_val_batches=0",
]
PLAN = '{"policy": "mgwfbp", "world_size": 2, "buckets": [["fc.weight"]]'


def strict_json(path: Path) -> object:
    """`path` read as a strict parser reads it: a bare NaN or Infinity fails."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{path.name} holds a bare {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize(
    "extra, key, shown",
    [
        (', "predicted_s": NaN', "predicted_s", "NaN"),
        (', "predicted_s": Infinity', "predicted_s", "Infinity"),
        (', "predicted_s": 1e999', "predicted_s", "Infinity"),
        (', "predicted_s": -0.5', "predicted_s", "-0.5"),
        (', "lower_bound_s": -Infinity', "lower_bound_s", "-Infinity"),
        (', "details": {"trials": [{"step_ms": NaN}]}', "details.trials[0].step_ms", "NaN"),
    ],
)
def test_a_plan_file_with_an_impossible_number_is_refused_naming_the_key(tmp_path, extra, key, shown):
    plan = tmp_path / "plan.json"
    plan.write_text(PLAN + extra + "}")
    with pytest.raises(CommSchedConfigError) as error:
        SavedPlan.load(plan)
    message = str(error.value)
    assert message.startswith("commsched: invalid ") and "plan_file" in message and str(plan) in message, message
    assert key in message and f"not {shown}" in message and "allowed: " in message, message
    assert "\n" not in message


@pytest.mark.parametrize("size", ["NaN", "2.5", "0", "-1", '"two"', "true"])
def test_a_plan_file_world_size_must_be_a_whole_number_of_workers(tmp_path, size):
    plan = tmp_path / "plan.json"
    plan.write_text(f'{{"policy": "mgwfbp", "world_size": {size}, "buckets": [["fc.weight"]]}}')
    with pytest.raises(CommSchedConfigError) as error:
        SavedPlan.load(plan)
    message = str(error.value)
    assert "world_size is a whole number of workers >= 1" in message and "cannot convert" not in message, message


def test_a_null_prediction_loads_as_no_prediction(tmp_path):
    """What `write_json` makes of a prediction that was NaN: null, read back as "no prediction"."""
    plan = tmp_path / "plan.json"
    SavedPlan("mgwfbp", 2, [["fc.weight"]], predicted_s=float("nan"), lower_bound_s=float("inf")).save(plan)
    assert strict_json(plan)["predicted_s"] is None
    loaded = SavedPlan.load(plan)
    assert loaded.predicted_s is None and loaded.lower_bound_s is None and loaded.world_size == 2


def test_a_plan_file_with_nan_is_refused_before_any_worker(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(PLAN + ', "predicted_s": NaN}')
    proc = subprocess.run(
        [str(BIN / "commsched-train"), f"hydra.run.dir={tmp_path / 'run'}", *QUIET, *TINY, f"fusion.plan_file={plan}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "fusion.plan_file" in proc.stderr and "predicted_s" in proc.stderr and "NaN" in proc.stderr


def timings(**change: object) -> str:
    content = {"forward": 1.0, "backward": [1.0, 2.0], "costs": [[3.0, 3.0], [4.0, 4.0]], **change}
    return json.dumps(content, allow_nan=True)


@pytest.mark.parametrize(
    "change, key, shown",
    [
        ({"forward": float("nan")}, "forward", "NaN"),
        ({"backward": [1.0, float("inf")]}, "backward[1]", "Infinity"),
        ({"costs": [[3.0, -3.0], [4.0, 4.0]]}, "costs[0][1]", "-3.0"),
        ({"costs": [[3.0, 3.0], [4.0, "NaN"]]}, "costs[1][1]", "'NaN'"),
        ({"reduce_scatter": [[1.0, float("-inf")]], "all_gather": [[1.0, 1.0]]}, "reduce_scatter[0][1]", "-Infinity"),
    ],
)
def test_a_timings_file_with_an_impossible_time_is_refused_naming_the_key(tmp_path, change, key, shown):
    from commsched.deft.measure import check_timings_file, load_timings

    path = tmp_path / "timings.json"
    path.write_text(timings(**change))
    for load in (check_timings_file, lambda p: load_timings(p, 2)):
        with pytest.raises(CommSchedConfigError) as error:
            load(str(path))
        message = str(error.value)
        assert message.startswith("commsched: invalid ") and "timings_file" in message and str(path) in message, message
        assert f"whose {key} is a finite number of seconds >= 0, not {shown}" in message, message


def test_a_good_timings_file_still_loads(tmp_path):
    from commsched.deft.measure import check_timings_file, load_halves, load_timings

    path = tmp_path / "timings.json"
    path.write_text(timings(reduce_scatter=[[0.5, 0.5]], all_gather=[[0.0, 0.5]]))
    check_timings_file(str(path))
    assert load_timings(str(path), 2).backward == [1.0, 2.0]
    assert load_halves(str(path), 2) == ([[0.5, 0.5]], [[0.0, 0.5]])


def test_a_timings_file_with_nan_is_refused_before_any_worker(tmp_path):
    path = tmp_path / "timings.json"
    path.write_text('{"forward": 1.0, "backward": [NaN], "costs": [[3.0], [4.0]]}')
    proc = subprocess.run(
        [
            str(BIN / "commsched-train"),
            f"hydra.run.dir={tmp_path / 'run'}",
            *QUIET,
            *TINY,
            "schedule=deft",
            f"deft.timings_file={path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "deft.timings_file" in proc.stderr and "backward[0]" in proc.stderr and "NaN" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written, and Hydra's folder removed


def test_a_run_with_no_step_timed_writes_strict_json_and_says_so(tmp_path):
    """Resumed at the step it was to end at, a run times no step: its step time is missing (null in
    the files, not NaN), and the summary line says so instead of failing on it."""

    def train(run: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                str(BIN / "commsched-train"),
                f"hydra.run.dir={tmp_path / run}",
                *QUIET,
                *TINY,
                "schedule=wfbp",
                "trainer.max_steps=2",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )

    first = train("first")
    assert first.returncode == 0, first.stderr[-3000:]
    again = train("again", f"resume={tmp_path / 'first'}")
    assert again.returncode == 0, again.stderr[-3000:]
    metrics = strict_json(tmp_path / "again" / "metrics.json")
    summary = strict_json(tmp_path / "again" / "summary.json")
    assert metrics["step_ms"] is None and metrics["samples_per_s"] is None
    assert summary["step_ms"] is None and summary["samples_per_s"] is None
    assert "no step timed" in again.stdout + again.stderr and "Traceback" not in again.stderr
    for run in ("first", "again"):
        for name in ("metrics.json", "summary.json"):
            strict_json(tmp_path / run / name)
