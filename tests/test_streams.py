"""Several streams: units dispatched deterministically, weights equal to ddp with any
S and U and through the search itself, identical unit-to-stream records on every rank under random
per-rank delays, the decision kept in checkpoints, a search cut short going on from its trials on
resume, drift re-opening the search, the closing line and the trials file of a run shorter than its
search; the bandit's formula against hand-computed values, and the search against brute force on
synthetic cost surfaces."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
import torch
from torch import nn

import commsched
from commsched.comm.buckets import build_plan
from commsched.fusion import plan_fixed
from commsched.options import StreamOptions
from commsched.streams import Striping, plan_units
from commsched.streams.bandit import AUCBandit
from commsched.streams.control import StreamControl
from commsched.streams.search import StreamSearch
from commsched.streams.space import Space
from conftest import WORKERS, max_abs_diff, per_link, run_worker


# ------------------------------------------------------------------ units
@pytest.mark.parametrize("streams, unit_bytes, world", [(1, 64, 2), (3, 64, 2), (4, 100, 3), (2, 4, 4), (16, 4096, 2)])
def test_units_tile_every_bucket_and_go_round_robin(streams, unit_bytes, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 33), nn.Linear(33, 5), nn.Linear(5, 300))
    plan = build_plan(model, world, lambda infos: plan_fixed(infos, cap_bytes=2000))
    units = plan_units(plan, Striping(streams, unit_bytes / 2**20))
    flat = [u for bucket_units in units for u in bucket_units]
    assert (
        [u.stream for u in flat] == [i % streams for i in range(len(flat))]
        if streams > 1
        else all(u.stream == 0 for u in flat)
    )
    for bucket, mine in zip(plan.buckets, units):
        covered = torch.zeros(bucket.buffer.numel(), dtype=torch.int64)
        for u in mine:
            assert u.bucket == bucket.index and u.numel % world == 0 and u.numel > 0
            assert streams == 1 or u.numel * 4 <= max(unit_bytes, 4 * world)
            covered[u.start : u.start + u.numel] += 1
        assert bool((covered == 1).all())
        if streams == 1:
            assert len(mine) == 1


# ------------------------------------------------------------------ bandit
def test_the_bandit_scores_as_computed_by_hand():
    bandit = AUCBandit(["grid", "bayes", "population", "hyperband"], exploration=0.2, window=25)
    for use in [("grid", True), ("bayes", False), ("grid", False), ("grid", True), ("population", False)]:
        bandit.record(*use)
    # grid: wins at its 1st and 3rd use: (1 + 3) * 2 / (3 * 4); explored sqrt(2 log2(5) / 3)
    assert bandit.auc("grid") == pytest.approx(2 / 3)
    assert bandit.score("grid") == pytest.approx(2 / 3 + 0.2 * math.sqrt(2 * math.log2(5) / 3))
    assert bandit.score("bayes") == pytest.approx(0.2 * math.sqrt(2 * math.log2(5)))
    assert bandit.score("hyperband") == math.inf
    assert bandit.ranked() == ["hyperband", "grid", "bayes", "population"]  # ties keep the order given
    small = AUCBandit(["grid", "bayes"], exploration=0.2, window=3)
    for use in [("bayes", True), ("grid", False), ("grid", True), ("grid", True)]:
        small.record(*use)
    # the window holds the last three uses, all grid's: wins at 2 and 3 -> (2 + 3) * 2 / (3 * 4)
    assert small.uses("bayes") == 0 and small.auc("grid") == pytest.approx(10 / 12)
    assert small.choose() == "bayes"


# ------------------------------------------------------------------ the search, offline
def capped_network(s: Striping, two_level_gain: float = 1.0) -> float:
    """60 MB all-reduced over 250 Mbit per flow, 1 Gbit per node: more streams help up to four, each
    unit costs a latency, each stream an overhead; node first saves 10% where searched."""
    bandwidth = min(s.streams * 250, 1000) / 8
    units = math.ceil(60 / s.unit_mb) if s.streams > 1 else 1
    seconds = 0.3 + 2 * 60 / bandwidth + 0.004 * units / s.streams + 0.003 * s.streams
    return seconds * (two_level_gain if s.hierarchical else 1.0)


def bowl(seed: int):
    draw = random.Random(seed)
    s0, u0, a, b = draw.uniform(0, 4), draw.uniform(-1, 5), draw.uniform(0.05, 0.5), draw.uniform(0.02, 0.2)
    return lambda s: (
        1
        + a * (math.log2(s.streams) - s0) ** 2
        + (b * (math.log2(s.unit_mb) - u0) ** 2 if s.streams > 1 else 0)
        + (0.3 if s.streams == 1 else 0)
    )


def searched(cost, space: Space, seed: int, trials: int = 25) -> float:
    """The search's final choice's true cost over the optimum (brute force), measurements with 2% noise."""
    noise = random.Random(seed + 100)
    search = StreamSearch(space, [Striping(1, 4.0)], seed=seed)
    for _ in range(trials):
        technique, proposed = search.propose()
        search.record(technique, proposed, cost(proposed) * (1 + noise.gauss(0, 0.02)))
    assert {t.technique for t in search.trials} >= {"start", "grid", "bayes", "population"}
    return cost(search.best()[0]) / min(cost(s) for s in space.all())


@pytest.mark.parametrize("surface", ["capped", "capped-two-level", "bowl"])
def test_the_search_lands_within_5_percent_of_the_optimum_in_90_percent_of_seeds(surface):
    space = Space.of(16, 0.5, 32, two_level=surface == "capped-two-level")
    assert len(space.all()) > 4 * 25  # 25 trials see under a quarter of the space
    ratios = []
    for seed in range(10):
        cost = bowl(seed) if surface == "bowl" else lambda s: capped_network(s, 0.9)
        ratios.append(searched(cost, space, seed))
    assert sum(r <= 1.05 for r in ratios) >= 9, ratios


def test_a_checkpointed_choice_is_kept_unless_asked_to_search_again():
    saved = {"chosen": Striping(4, 2.0).to_json(), "chosen_s": 0.5, "trials": [{"technique": "start"}]}
    kept = StreamControl("auto", StreamOptions())
    assert kept.load_state_dict(saved) and kept.striping == Striping(4, 2.0) and not kept.searching
    assert kept.state_dict()["chosen"] == saved["chosen"]
    again = StreamControl("auto", StreamOptions(retune_on_resume=True))
    assert not again.load_state_dict(saved) and again.searching and again.striping.streams == 1
    fixed = StreamControl(3, StreamOptions(unit_mb=1.0))  # the user's fixed choice wins over the checkpoint's
    assert not fixed.load_state_dict(saved) and fixed.striping == Striping(3, 1.0) and fixed.state_dict() == {}


class Broadcast:
    """The control link of two ranks stepped in turn: rank 0's object goes to rank 1's next call."""

    def __init__(self, rank: int, sent: list) -> None:
        self.rank, self._sent = rank, sent

    def broadcast_object(self, value: object, src: int, tag: str) -> object:
        if self.rank == 0:
            self._sent.append(value)
            return value
        return self._sent.pop(0)


def stepped(ranks: list[StreamControl], steps: int) -> list[list[Striping]]:
    """`steps` iteration boundaries on both ranks; per step, the configuration each rank runs."""
    sent: list = []
    links = [Broadcast(r, sent) for r in range(len(ranks))]
    ran = []
    for _ in range(steps):
        for control, link in zip(ranks, links):
            control.at_boundary(link)
        ran.append([c.striping for c in ranks])
    return ran


SMALL_SEARCH = StreamOptions(
    warmup_steps=1, trial_steps=2, budget_steps=12, max_streams=4, min_unit_mb=1.0, max_unit_mb=4.0
)
CONFIRMING = 2 * SMALL_SEARCH.confirm_rounds * 2
"""Steps after the search while its best and one stream take turns: 2 arms, the rounds, a switch step and one timed."""


def test_a_search_resumed_half_way_replays_its_trials_and_keeps_its_budget():
    before = [StreamControl("auto", SMALL_SEARCH) for _ in range(2)]
    ran = stepped(before, 8)  # warm-up, then trials 1-3 recorded, trial 4 under way
    assert all(a == b for a, b in ran) and len(before[0].trials) == 3
    saved = before[0].state_dict()
    assert before[1].state_dict() == saved  # communication state: equal on every rank, saved once
    after = [StreamControl("auto", SMALL_SEARCH) for _ in range(2)]
    assert all(c.load_state_dict(saved) for c in after)
    assert [c.striping for c in after] == [before[0].striping] * 2 and all(c.searching for c in after)
    ran = stepped(after, 12 + CONFIRMING)
    assert all(a == b for a, b in ran)  # both ranks run the same configuration at every step
    trials = after[0].trials
    assert trials[:3] == before[0].trials and after[1].trials == trials
    assert len(trials) == 6  # the budget's 12 steps over 2 a trial, 6 in both runs together, not 6 more
    assert Striping.from_json(trials[3]) == before[0].striping  # the trial the checkpoint caught is measured again
    measured = [Striping.from_json(t) for t in trials]
    assert len(set(measured)) == len(measured)  # nothing measured twice: one stream only in trial 1
    assert after[0].chosen is not None and not after[0].searching
    assert not after[0].load_state_dict(saved)  # running: a bucket rebuild's hand-back restores nothing
    again = StreamControl("auto", replace(SMALL_SEARCH, retune_on_resume=True))
    assert not again.load_state_dict(saved) and again.trials == [] and again.striping.streams == 1


def test_the_closing_line_says_which_configuration_ran():
    assert StreamControl(1, StreamOptions()).finish() is None
    assert StreamControl(4, StreamOptions(unit_mb=4.0)).finish() == "streams: 4 streams, 4 MB units (fixed)"
    fresh = StreamControl("auto", SMALL_SEARCH)
    assert (
        fresh.finish()
        == (
            "streams search unfinished after 0 of ~6 trials: ran 1 stream; nothing measured yet; "
            "resume or run longer to finish it"
        )
        and fresh.files() == []
    )


# ------------------------------------------------------------------ real runs
CASES = [
    "ddp-s1",
    "wfbp-s3",
    "dear-s3",
    "wfbp-auto",
    "dear-auto",
    "wfbp-s4-delayed",
    "dear-s4-delayed",
    "ddp-s1-part",
    "ddp-s1-resumed",
    "dear-auto-part",
    "dear-auto-resumed",
    "wfbp-auto-drift",
    "wfbp-s3-profiled",
    "ddp-s1-cut",
    "ddp-s1-cut-resumed",
    "dear-auto-cut",
    "dear-auto-cut-resumed",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("streams")
    proc = run_worker("run_streams.py", str(out), *CASES, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"stream runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")

    def loaded(case: str, rank: int = 0) -> dict:
        return torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)

    loaded.out = out  # the runs' folders: out/<case>
    return loaded


@pytest.mark.parametrize("case", ["wfbp-s3", "dear-s3", "wfbp-auto", "dear-auto", "wfbp-s4-delayed", "dear-s4-delayed"])
def test_any_streams_and_the_search_itself_equal_ddp(runs, case):
    for rank in (0, 1):
        diff, key = max_abs_diff(runs(case, rank)["state"], runs("ddp-s1", rank)["state"])
        assert diff <= 1e-5, f"{case}, rank {rank}: {key} differs from ddp by {diff:.3g}"


@pytest.mark.parametrize("case", ["wfbp-s3", "dear-s3", "wfbp-s4-delayed", "dear-s4-delayed", "wfbp-auto", "dear-auto"])
def test_every_rank_records_the_same_units_on_the_same_streams(runs, case):
    traces = [per_link(runs(case, rank)["trace"]) for rank in (0, 1)]
    assert traces[0] == traces[1]
    if case.endswith(("s3", "s4-delayed")):
        streams = int(case.split("-")[1][1:])
        assert {f"primary.{i}" for i in range(1, streams)} <= set(traces[0])
        for name in [n for n in traces[0] if n.startswith("primary")]:
            assert len(traces[0][name]) > 0


def test_every_stream_carries_bytes_and_the_profiler_shows_each_busy(runs):
    import json

    wire = runs("wfbp-s3")["wire_bytes"]
    assert all(wire[f"primary{suffix}"] > 0 for suffix in ("", ".1", ".2"))
    profile = runs("wfbp-s3-profiled")["profile"]
    for name in ("primary", "primary.1", "primary.2"):
        assert profile["summary"]["wire_bytes"][name] > 0 and profile["summary"]["busy_s"][name] > 0
    assert 0 < profile["summary"]["busy_s"]["primary"] < profile["summary"]["step_s"]
    trace = json.loads(open(profile["files"]["trace"]).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
    assert {"link: primary", "link: primary.1", "link: primary.2"} <= lanes  # one row per stream


def test_the_search_ends_with_one_choice_on_every_rank_and_keeps_it_on_resume(runs):
    for case in ("wfbp-auto", "dear-auto", "dear-auto-part"):
        chosen = [runs(case, rank)["chosen"] for rank in (0, 1)]
        assert chosen[0] is not None and chosen[0] == chosen[1]
        assert runs(case, 0)["trials"] == runs(case, 1)["trials"]
        assert runs(case, 0)["trials"][0]["streams"] == 1  # one stream is measured first: the baseline
    part, resumed = runs("dear-auto-part"), runs("dear-auto-resumed")
    assert resumed["chosen"] == part["chosen"] and resumed["trials"] == part["trials"]  # reused, not searched again
    for rank in (0, 1):
        diff, key = max_abs_diff(runs("dear-auto-resumed", rank)["state"], runs("ddp-s1-resumed", rank)["state"])
        assert diff <= 1e-5, f"rank {rank}: {key} differs from ddp resumed by {diff:.3g}"


@pytest.mark.parametrize("case", ["wfbp-auto", "dear-auto", "wfbp-auto-drift"])
def test_the_search_makes_groups_as_it_tries_them_and_releases_the_unused_once_settled(runs, case):
    """Counted in torch's registry of process groups: the default group and one per stream alive."""
    for rank in (0, 1):
        run = runs(case, rank)
        alive = run["groups_alive"]
        assert alive[0] == 2  # the default group and the primary's first stream, nothing made ahead
        assert max(alive) <= 1 + 4  # at most max_streams of the primary while searching
        assert max(alive) > 2 or all(t["streams"] == 1 for t in run["trials"])  # a trial with streams made them
        assert alive[-1] == 1 + Striping.from_json(run["chosen"]).streams  # settled: the rest released


def test_a_search_cut_short_goes_on_from_its_trials_on_resume(runs):
    """dear-auto-cut checkpointed at step 6 with 2 of its 4 trials measured (it ran on to step 8, a
    third); resumed from there, the search measures the third again, then a fourth, and chooses."""
    cut, resumed = runs("dear-auto-cut"), runs("dear-auto-cut-resumed")
    assert (
        resumed["trials"][:2] == cut["trials"][:2] and len(resumed["trials"]) == 4
    )  # the budget kept, not spent again
    assert [t["streams"] for t in resumed["trials"]].count(1) == 1  # trial 1's one stream not measured again
    measured = [Striping.from_json(t) for t in resumed["trials"]]
    assert len(set(measured)) == 4 and measured[2] == Striping.from_json(cut["trials"][2])  # where it stopped
    assert (
        "commsched streams: resuming the search at trial 3 of about 4 (4 steps of its budget left)" in resumed["said"]
    )
    for rank in (0, 1):
        assert runs("dear-auto-cut-resumed", rank)["trials"] == resumed["trials"]
        assert runs("dear-auto-cut-resumed", rank)["chosen"] == resumed["chosen"] is not None
        diff, key = max_abs_diff(
            runs("dear-auto-cut-resumed", rank)["state"], runs("ddp-s1-cut-resumed", rank)["state"]
        )
        assert diff <= 1e-5, f"rank {rank}: {key} differs from ddp resumed by {diff:.3g}"
    assert per_link(runs("dear-auto-cut-resumed", 0)["trace"]) == per_link(runs("dear-auto-cut-resumed", 1)["trace"])


def test_a_run_shorter_than_the_search_says_which_configuration_it_ran(runs):
    cut = runs("dear-auto-cut")
    assert cut["chosen"] is None and len(cut["trials"]) == 3
    ran, best = Striping.from_json(cut["striping"]).describe(), min(cut["trials"], key=lambda t: t["step_s"])
    assert cut["finish"].startswith(
        f"streams search unfinished after 3 of ~4 trials: ran {ran}; "
        f"best measured {Striping.from_json(best).describe()} ({best['step_s'] * 1e3:.1f} ms/step"
    )
    assert cut["finish"].endswith("resume or run longer to finish it")
    assert runs("dear-auto-cut", 1)["finish"] == cut["finish"]  # every rank can say it
    assert cut["finish"] not in cut["said"]  # not said on its own: the caller prints it, in its closing summary
    # every trial says how far the search is: 8 steps of budget, 2 a trial
    trials = [line for line in cut["said"] if line.startswith("commsched streams: trial ")]
    assert [line.split(" (")[0] for line in trials] == [f"commsched streams: trial {i}/~4" for i in (1, 2, 3)]
    assert trials[0].startswith("commsched streams: trial 1/~4 (start): 1 stream: ")
    assert trials[0].endswith("ms/step (best so far; about 6 steps of the search left)")
    assert trials[2].endswith("about 2 steps of the search left)")
    finished = runs("wfbp-auto")["finish"]
    chosen = Striping.from_json(runs("wfbp-auto")["chosen"]).describe()
    assert finished.startswith(f"streams: {chosen}, chosen after 4 trials"), finished
    assert runs("wfbp-s3")["finish"] == f"streams: 3 streams, {160 / 2**20:g} MB units (fixed)"


def test_the_trials_land_in_the_runs_folder_from_rank_0_only(runs):
    """The worker's Trainers have no logger: the run's folder is default_root_dir (out/<case>)."""
    for case, chosen in (("dear-auto-cut", False), ("dear-auto-cut-resumed", True), ("wfbp-auto", True)):
        folder = runs.out / case
        assert runs(case, 0)["files"] == [str(folder / f"commsched_streams.{kind}") for kind in ("json", "md", "png")]
        assert runs(case, 1)["files"] == []
        saved = json.loads((folder / "commsched_streams.json").read_text())
        assert saved["trials"] == runs(case)["trials"] and (saved["chosen"] is not None) == chosen
        assert not list(folder.glob(".partial-*"))
    assert not (WORKERS / "commsched_streams.json").exists() and not (runs.out / "commsched_streams.json").exists()


def test_a_slower_network_after_the_search_reopens_it_from_one_stream(runs):
    trials = runs("wfbp-auto-drift")["trials"]
    first = next(i for i, t in enumerate(trials) if i > 0 and t["technique"] == "start")  # the re-opened search
    assert first >= 4 and trials[first - 1]["technique"] != "start"
    reopened = trials[first:]
    assert any(t["streams"] == 1 for t in reopened)
    assert min(t["step_s"] for t in reopened) > 2 * min(
        t["step_s"] for t in trials[:first]
    )  # measured after the slow-down


def test_bad_stream_values_are_refused_before_spawning():
    with pytest.raises(commsched.CommSchedConfigError, match=r"StreamOptions\(count=0\).*1\.\.16"):
        commsched.WFBPStrategy(streams=StreamOptions(count=0))
    with pytest.raises(commsched.CommSchedConfigError, match=r"streams='fast'.*StreamOptions or \"auto\""):
        commsched.DeARStrategy(streams="fast")
    with pytest.raises(commsched.CommSchedConfigError, match=r"streams=4.*Fix: e.g. streams=StreamOptions\(count=4\)"):
        commsched.WFBPStrategy(streams=4)
    with pytest.raises(commsched.CommSchedConfigError, match=r"StreamOptions\(count=4\).*1 with schedule deft"):
        commsched.DeFTStrategy(streams=StreamOptions(count=4))
    with pytest.raises(commsched.CommSchedConfigError, match=r"StreamOptions\(count=2\).*compression method 'topk'"):
        commsched.WFBPStrategy(streams=StreamOptions(count=2), compression="topk")
    with pytest.raises(commsched.CommSchedConfigError, match=r"StreamOptions\(count='auto'\).*fusion policy 'bayes'"):
        commsched.DeARStrategy(streams="auto", fusion="bayes")
    with pytest.raises(commsched.CommSchedConfigError, match=r"StreamOptions\(max_streams=17\).*1\.\.16"):
        commsched.WFBPStrategy(streams=StreamOptions(count="auto", max_streams=17))
    with pytest.raises(commsched.CommSchedConfigError, match=r"StreamOptions\(min_unit_mb=8.0\).*max_unit_mb"):
        commsched.WFBPStrategy(streams=StreamOptions(count="auto", min_unit_mb=8.0, max_unit_mb=1.0))


def test_hydra_runs_the_search_and_leaves_its_trials_beside_the_run(tmp_path):
    import json

    from test_cli_everyday import SMALL, train

    run = tmp_path / "run"
    proc = train(
        run,
        *SMALL,
        "schedule=dear",
        "streams.count=auto",
        "streams.budget_steps=6",
        "streams.trial_steps=2",
        "streams.warmup_steps=1",
        "streams.max_streams=3",
        "streams.min_unit_mb=0.01",
        "streams.max_unit_mb=0.04",
        "trainer.devices=2",
        "trainer.max_steps=21",
        "checkpoint.enabled=false",
        "fusion=fixed",
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "commsched streams: trial 1/~3 (start): 1 stream: " in output
    assert (
        "commsched streams: chose" in output or "commsched streams: on alternating steps" in output
    )  # (best: one stream, or confirmed)
    saved = json.loads((run / "commsched_streams.json").read_text())
    assert saved["chosen"] is not None and len(saved["trials"]) == 3
    assert (run / "commsched_streams.png").stat().st_size > 0
    assert (run / "commsched_streams.md").read_text().count("\n| ") == len(saved["trials"])  # one row a trial
