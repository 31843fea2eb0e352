"""Shared fixtures: each world size runs its training cases once, in one real multi-process job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(autouse=True)
def leaves_no_process_group_behind():
    """A test that trains in the pytest process must not leave its process group (whose store holds
    MASTER_PORT) nor MASTER_PORT in the environment: every later worker would inherit the port, and
    fail to listen on it."""
    had_port = "MASTER_PORT" in os.environ
    yield
    left = torch.distributed.is_initialized() or ("MASTER_PORT" in os.environ and not had_port)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if not had_port:
        os.environ.pop("MASTER_PORT", None)
    assert not left, "the test left a process group or MASTER_PORT in the pytest process"


CASES_BY_WORLD = {
    2: [
        "ddp-sgd",
        "wfbp-sgd",
        "dear-sgd",
        "ddp-adamw",
        "wfbp-adamw",
        "dear-adamw",
        "ddp-value",
        "wfbp-value",
        "dear-value",
        "ddp-bf16",
        "dear-bf16",
        "ddp-fp16",
        "wfbp-fp16",
        "dear-fp16",
        "deft-fp16",
        "ddp-fp16-value",
        "dear-fp16-value",
        "dear-fp16-rank0-reads",
        "ddp-bf16hook",
        "ddp-fp16hook",
        "wfbp-bf16wire",
        "wfbp-fp16wire",
        "dear-bf16wire",
        "dear-fp16wire",
        "deft-bf16wire",
        "wfbp-bf16hook",
        "dear-bf16wire-streams",
        "ddp-bf16hook-unclipped",
        "dear-bf16wire-unclipped",
        "ddp-fp16hook-unclipped",
        "dear-fp16wire-unclipped",
        "dear-bf16wire-streams-unclipped",
        "ddp-sgd-unclipped",
        "dear-layers",
        "dear-onebucket",
        "dear-profiled",
        "ddp-eval",
        "dear-eval",
        "dear-iface",
        "deft-sgd",
        "deft-adamw",
        "deft-value",
        "hier-sgd",
    ],
    3: [
        "ddp-sgd",
        "wfbp-sgd",
        "dear-sgd",
        "ddp-adamw",
        "wfbp-adamw",
        "dear-adamw",
        "ddp-1ep",
        "dear-1ep",
        "ddp-2ep",
        "wfbp-2ep",
        "dear-2ep",
        "dear-fallback-2ep",
        "dear-fallback-1ep",
        "dear-fallback-resume",
        "dear-auto-fallback",
        "dear-auto-fallback-fixed",
        "dear-resume",
        "ddp-from-dear",
        "dear-from-ddp",
        "wfbp-from-ddp",
        "dear-unfreeze",
        "wfbp-unfreeze",
        "dear-mgwfbp",
        "dear-greedy",
        "wfbp-dear-model",
        "dear-planfile",
        "dear-bayes-1ep",
        "dear-bayes-resume",
        "dear-replan",
        "dear-auto",
        "wfbp-auto",
        "wfbp-auto-resume",
        "wfbp-1ep",
        "wfbp-resume",
        "localsum-1ep",
        "localsum-2ep",
        "localsum-resume",
        "localsum-bayes-2ep",
        "deft-unfreeze",
        "hier-sgd",
    ],
}


def run_worker(
    script: str, *args: str, timeout: float = 900, env: Optional[dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """Runs a worker script from tests/workers; `env` adds to this process's environment."""
    return subprocess.run(
        [sys.executable, str(WORKERS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=WORKERS,
        env={**os.environ, **(env or {})},
    )


class CaseResults:
    """Loads `<case>.rank<r>.pt` written by workers/run_cases.py."""

    def __init__(self, directory: Path, world: int) -> None:
        self.directory = directory
        self.world = world

    def load(self, case: str, rank: int = 0) -> dict:
        return torch.load(self.directory / f"{case}.rank{rank}.pt", weights_only=False)

    def all_ranks(self, case: str) -> list[dict]:
        return [self.load(case, r) for r in range(self.world)]


@pytest.fixture(scope="session")
def cases(tmp_path_factory) -> Callable[[int], CaseResults]:
    done: dict[int, CaseResults] = {}

    def get(world: int) -> CaseResults:
        if world not in done:
            out = tmp_path_factory.mktemp(f"cases-ws{world}")
            proc = run_worker("run_cases.py", str(out), str(world), *CASES_BY_WORLD[world])
            if proc.returncode != 0:
                pytest.fail(
                    f"training cases at world size {world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
                )
            done[world] = CaseResults(out, world)
        return done[world]

    return get


def ended_with_an_error(proc: subprocess.CompletedProcess, status: int = 1) -> None:
    """The run ended as an error ends (1: a Python error, its traceback said; 2: a refused setting, as
    command lines say it), not killed by a signal (a negative status: SIGKILL, SIGABRT) nor aborted
    while exiting (134: an abort in a thread left in a backend)."""
    assert proc.returncode == status, (
        f"exit status {proc.returncode}, not a clean error exit ({status}):\n{proc.stderr[-3000:]}"
    )


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest element-wise difference over every entry of two state dicts (parameters and buffers)."""
    assert a.keys() == b.keys()
    worst = (0.0, "")
    for key in a:
        diff = (a[key].double() - b[key].double()).abs().max().item() if a[key].numel() else 0.0
        worst = max(worst, (diff, key))
    return worst


def assert_same_as_reference(load: Callable[..., dict], case: str, reference: str, tolerance: float) -> None:
    """Both ranks' weights (`"state"`) and optimizer states (`"optimizer"`) of `case` within `tolerance` of
    `reference`'s, as `load(case, rank)` returns them."""
    for rank in (0, 1):
        got, expected = load(case, rank), load(reference, rank)
        diff, where = max_abs_diff(got["state"], expected["state"])
        assert diff <= tolerance, f"{case}, rank {rank}: {diff:.2e} from {reference} at {where}"
        diff, where = max_abs_diff(got["optimizer"], expected["optimizer"])
        assert diff <= tolerance, f"{case}, rank {rank}: optimizer state {diff:.2e} from {reference} at {where}"


def per_link(trace: list[tuple]) -> dict[str, list[tuple]]:
    """A collective trace split by link (process group): the order that must match across ranks."""
    links: dict[str, list[tuple]] = {}
    for record in trace:
        links.setdefault(record[0], []).append(record)
    return links


@pytest.fixture
def hydra_syntax():
    """Refusals rendered as `commsched-train` renders them (its entry point sets this)."""
    from commsched import errors

    errors.use_syntax("hydra")
    yield
    errors.use_syntax("python")


# The compression runs, made once per session for the files that read them (imported last: that module
# imports the helpers above).
from compression_reference import runs, two_nodes  # noqa: E402,F401

QUICK = {
    "test_buckets",
    "test_compensation_choice",
    "test_data",
    "test_deft_planning",
    "test_docs",
    "test_generations",
    "test_per_parameter",
    "test_schedule_options",
    "test_house",
    "test_interleaved",
    "test_models",
    "test_moved",
    "test_sim",
    "test_stability",
    "test_watch",
    "test_works",
}
"""Test files that start no worker process: the `quick` tier (`make test-quick`), for the edit-test loop.
The whole suite (`make test`, what CI runs) takes about 35 minutes on 2 cores, most of it real
multi-process training runs."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in QUICK:
            item.add_marker(pytest.mark.quick)
