"""Sparse embeddings (`nn.Embedding(sparse=True)`, `nn.EmbeddingBag(sparse=True)`): their gradients stay out
of the buckets and are averaged as sparse tensors at the end of each synchronised backward, as DDP averages
them (workers/run_sparse.py, 2 processes: a recommender's embeddings into an MLP, with SGD, Adagrad, and
SparseAdam beside Adam by hand and under Fabric). Every schedule trains what Lightning's ddp trains; only
the rows some rank touched travel; `average_sparse` agrees with a brute-force sum on 3 processes."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_as_reference, run_worker

TOLERANCE = 1e-5
ROWS, WIDTH, STEPS = 400, 8, 8  # run_sparse.py's item embedding, and its optimizer steps
EXACT = [
    "sgd-wfbp",
    "sgd-dear",
    "sgd-deft",
    "sgd-defaults",
    "sgd-traced",
    "adagrad-dear",
    "split-dear",
    "split-wfbp",
    "fabric-dear",
    "fabric1-dear",
    "fabricapart-dear",
    "sgd-dear-resume",
]
REFUSED = ["sgd-topk", "sgd-hook", "tied-dear"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sparse")
    references = sorted({f"{case.split('-')[0]}-ddp" for case in EXACT})
    proc = run_worker("run_sparse.py", str(out), *references, *EXACT, *REFUSED)  # refused last: they stop a fit
    if proc.returncode != 0:
        pytest.fail(f"runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    load = lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.output = proc.stdout + proc.stderr
    return load


@pytest.mark.parametrize("case", EXACT)
def test_trains_what_ddp_trains(runs, case):
    assert_same_as_reference(runs, case, f"{case.split('-')[0]}-ddp", TOLERANCE)


def test_the_embeddings_train(runs):
    """Equal to embeddings that never moved would prove nothing."""
    moved = runs("sgd-ddp")["moved"]
    assert moved["items.weight"] > 1e-3 and moved["tags.weight"] > 1e-3, moved


def test_only_the_rows_some_rank_touched_travel_the_same_on_every_rank(runs):
    traces = [runs("sgd-traced", rank)["trace"] for rank in (0, 1)]
    assert traces[0] == traces[1], "the ranks issued different collectives"
    sent = [numel for _, op, tag, numel in traces[0] if tag == "sparse"]  # bytes: both tables' rows and values
    assert len(sent) == STEPS, "one message a step for both tables"
    assert max(sent) < ROWS * WIDTH * 4, (max(sent), ROWS * WIDTH * 4)  # less than the item table, dense
    assert all("sparse" not in tag for _, op, tag, _ in traces[0] if op == "all_reduce")


def test_dear_and_deft_say_why_wfbp_runs(runs):
    assert "the model has sparse gradients (net.items.weight, net.tags.weight)" in runs.output


@pytest.mark.parametrize("case, field", [("sgd-topk", "compression"), ("sgd-hook", "ddp_comm_hook")])
def test_what_sparse_gradients_cannot_have_is_refused_with_the_way_out(runs, case, field):
    message = runs(case)["refused"]
    assert f"invalid {field}" in message and "dense embeddings (sparse=False)" in message, message


def test_a_sparse_table_whose_gradient_turns_dense_is_refused_with_the_way_out(runs):
    message = runs("tied-dear")["refused"]
    assert "'net.items.weight' belongs to an embedding made with sparse=True, but its gradient is dense" in message
    assert "Make the embedding dense (sparse=False)" in message


def test_average_sparse_agrees_with_a_brute_force_sum(tmp_path):
    proc = run_worker("run_sparse_average.py", str(tmp_path), timeout=300)
    assert proc.returncode == 0 and (tmp_path / "ok").exists(), proc.stderr[-4000:]
