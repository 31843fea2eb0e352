"""Choices on real steps: arms take turns, the switch step is left out, and a candidate replaces
the default only when it wins by more than the measured noise (checked on synthetic step times
with known noise, against closed forms)."""

from __future__ import annotations

import random
from typing import Optional

import pytest

from commsched.interleaved import (
    BUDGET_FACTOR,
    MIN_MARGIN,
    MODEL_MARGIN,
    QUICK_ROUNDS,
    Comparison,
    MeasuredChoice,
    Rechecks,
    Turns,
    Verdict,
    favoured,
    relative_spread,
    verdict_from_samples,
)


def run_turns(turns: Turns, step_s: list[float]) -> list[int]:
    """Drive `turns` with a fake clock: each step of arm a takes step_s[a]; the arms run in order."""
    now, arm, ran = 0.0, 0, []
    while True:
        switch = turns.at_boundary(now)
        if switch is not None:
            arm = switch
        if turns.done:
            return ran
        ran.append(arm)
        now += step_s[arm]


def test_each_arm_takes_its_turns_and_its_switch_steps_are_left_out():
    turns = Turns(arms=2, steps_per_turn=3, rounds=2)
    ran = run_turns(turns, [0.1, 0.2])
    assert ran == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4  # one switch step + three timed, per turn
    assert turns.steps == 16
    assert turns.samples() == [pytest.approx([0.1] * 6), pytest.approx([0.2] * 6)]


def test_the_spread_is_the_pooled_median_absolute_deviation():
    assert relative_spread([[1.0, 1.0, 1.0], [2.0, 2.0]]) == 0.0
    # deviations 0.1, 0, 0.1 and 0, 0, 0 (relative to each arm's median): median 0 -> no spread
    assert relative_spread([[0.9, 1.0, 1.1], [2.0, 2.0, 2.0]]) == 0.0
    # every step 10% off its arm's median: 1.4826 * 0.1
    assert relative_spread([[0.9, 1.1, 0.9, 1.1, 1.0], [1.8, 2.2, 1.8, 2.2, 2.0]]) == pytest.approx(1.4826 * 0.1)


def test_a_clear_winner_is_kept_and_a_tie_goes_to_the_default():
    rng = random.Random(0)
    noisy = lambda mean, n: [mean * (1 + rng.gauss(0, 0.02)) for _ in range(n)]  # 2% noise
    verdict = verdict_from_samples([noisy(1.0, 9), noisy(0.8, 9)])
    assert verdict.keep == 1 and verdict.gain == pytest.approx(1.25, rel=0.05)
    tie = verdict_from_samples([noisy(1.0, 9), noisy(1.0, 9)])
    assert tie.keep == 0 and tie.gain == 1.0


def test_a_gain_inside_the_noise_is_not_taken():
    """5% faster under 10% noise with 9 steps an arm: the margin is about 2 x 1.2533 x sqrt(2/9) x 0.1 = 12%."""
    rng = random.Random(1)
    default = [1.0 * (1 + rng.gauss(0, 0.1)) for _ in range(9)]
    candidate = [0.95 * (1 + rng.gauss(0, 0.1)) for _ in range(9)]
    verdict = verdict_from_samples([default, candidate])
    assert verdict.margin > 0.08
    assert verdict.keep == 0


def test_a_quiet_machine_still_needs_the_minimum_margin():
    verdict = verdict_from_samples([[1.0] * 5, [1.0 - MIN_MARGIN / 2] * 5])
    assert verdict.margin == MIN_MARGIN and verdict.keep == 0
    assert (
        verdict_from_samples([[1.0] * 5, [0.9] * 5, [0.95] * 5]).keep == 1
    )  # the fastest candidate, when it clears the margin


# ------------------------------------------------------------------ the model and the measurement together
def test_the_arm_the_model_favours_is_kept_unless_the_steps_contradict_it_beyond_their_noise():
    rng = random.Random(2)
    noisy = lambda mean, n: [mean * (1 + rng.gauss(0, 0.1)) for _ in range(n)]  # 10% noise: a margin near 12%
    leaning = verdict_from_samples(
        [noisy(1.0, 9), noisy(1.03, 9)], predicted=[1.18, 1.0]
    )  # model: the candidate, 18% faster
    assert leaning.favoured == 1 and leaning.keep == 1  # 3% the other way is inside the noise: the model's arm
    clear = verdict_from_samples([[1.0] * 9, [1.3] * 9], predicted=[1.18, 1.0])
    assert clear.keep == 0 and clear.resolved  # 30% slower on a quiet machine: the measurement overrules
    assert "overruled" in clear.describe(["wfbp", "dear"])


def test_a_prediction_within_the_models_margin_favours_the_default():
    assert favoured([1.0, 1.0 - MODEL_MARGIN / 2]) == 0
    assert favoured([1.0, 0.9]) == 1
    assert favoured(None) == 0 and favoured([1.0, float("nan")]) == 0
    # no clear prediction: the candidate needs the measurement beyond the noise, as without a model
    assert verdict_from_samples([[1.0] * 9, [0.995] * 9], predicted=[1.0, 0.99]).keep == 0


def test_steps_that_lean_against_the_model_within_the_noise_are_not_resolved():
    verdict = verdict_from_samples(
        [[1.0, 1.1, 0.9] * 3, [1.03, 1.13, 0.93] * 3], predicted=[1.0, 0.8]
    )  # 3% slower, 10% spread
    assert verdict.favoured == 1 and verdict.keep == 1 and not verdict.resolved
    agree = verdict_from_samples([[1.0, 1.1, 0.9] * 3, [0.8, 0.88, 0.72] * 3], predicted=[1.0, 0.8])
    assert agree.resolved and agree.keep == 1 and "confirmed" in agree.describe(["a", "b"])


def test_added_rounds_continue_the_turns_where_they_ended():
    turns = Turns(arms=2, steps_per_turn=2, rounds=1)
    ran = run_turns(turns, [0.1, 0.2])
    assert ran == [0, 0, 0, 1, 1, 1]
    turns.add_rounds(1)
    now, arm, more = 10.0, ran[-1], []
    while True:
        switch = turns.at_boundary(now)
        arm = switch if switch is not None else arm
        if turns.done:
            break
        more.append(arm)
        now += [0.1, 0.2][arm]
    assert more == [0, 0, 0, 1, 1, 1] and turns.rounds == 2
    assert turns.samples() == [pytest.approx([0.1] * 4), pytest.approx([0.2] * 4)]  # switch steps left out


def drive(comparison: Comparison, step_s, control, limit: int = 400) -> tuple[Verdict, int]:
    """Steps of each arm take `step_s(arm, i)`; returns the verdict and the steps it took."""
    now, arm, i = 0.0, 0, 0
    while i < limit:
        switch = comparison.at_boundary(now)
        arm = switch if switch is not None else arm
        if comparison.done:
            verdict = comparison.conclude(control)
            if verdict is not None:
                return verdict, i
            continue
        now += step_s(arm, i)
        i += 1
    raise AssertionError("the comparison never ended")


def test_agreement_is_quick_and_disagreement_takes_more_turns_up_to_the_budget(one_process_link):
    quick, steps = drive(
        Comparison(2, 3, 3, predicted=[1.0, 0.8]),
        lambda arm, i: [1.0, 0.8][arm] * (1 + 0.05 * (i % 3 - 1)),
        one_process_link,
    )
    assert quick.keep == 1 and quick.resolved and steps == QUICK_ROUNDS * 2 * 4  # agreement ends it early
    # the candidate measures 2% slower under a 10% spread (the same in every turn): never beyond the
    # noise, so the budget is spent and the model's arm kept
    noisy = lambda arm, i: [1.0, 1.02][arm] * (1 + 0.1 * ((i % 4) - 1.5) / 1.5)
    slow, steps = drive(Comparison(2, 3, 3, predicted=[1.0, 0.8]), noisy, one_process_link)
    assert not slow.resolved and slow.keep == 1 and steps == 3 * BUDGET_FACTOR * 2 * 4


@pytest.fixture
def one_process_link(tmp_path):
    """A real gloo group of one process and a commsched link on it: `slowest_rank_steps` runs its all-reduce."""
    import torch.distributed as dist

    from commsched.comm.links import Link

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield Link("control", None)
    dist.destroy_process_group()


def test_a_kept_choice_is_checked_again_later_on_longer_turns():
    checks = Rechecks(((5, 3), (12, 6)))
    factors = [checks.due() for _ in range(20)]
    assert [i + 1 for i, f in enumerate(factors) if f] == [5, 12] and [f for f in factors if f] == [3, 6]
    assert checks.done == 2


def test_overruling_the_model_takes_every_round_asked_for(one_process_link):
    """30% slower than predicted on a quiet machine: beyond the noise after two rounds already, but a
    verdict against the model waits for `rounds` rounds."""
    verdict, steps = drive(Comparison(2, 3, 4, predicted=[1.0, 0.8]), lambda arm, i: [1.0, 1.3][arm], one_process_link)
    assert verdict.keep == 0 and verdict.favoured == 1 and steps == 4 * 2 * 4


def test_a_resumed_choice_keeps_its_verdict_and_counts_on_to_its_next_check(one_process_link):
    """The state a checkpoint holds: the verdict (its arm runs at once, nothing is measured again) and
    the iterations toward the next check; a check the checkpoint caught half-way starts again at once."""
    import time

    def make() -> MeasuredChoice:
        return MeasuredChoice(
            confirm_steps=1, confirm_rounds=2, drift=10.0, drift_steps=100, warmup=1, rechecks=((6, 1),)
        )

    def step(choice: MeasuredChoice) -> Optional[int]:
        switched = choice.at_boundary(one_process_link)
        time.sleep(0.002 if choice.arm == 1 else 0.008)  # the candidate clearly faster
        return switched

    first = make()
    while first.deciding:
        step(first)
    assert first.verdict is not None and first.verdict.keep == 1
    step(first), step(first)  # two iterations toward the check, then the checkpoint
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert resumed.verdict == first.verdict and resumed.arm == 1 and not resumed.deciding
    assert [step(resumed) for _ in range(4)] == [
        None,
        None,
        None,
        0,
    ]  # the check at 6 iterations after the verdict, not sooner
    caught = make()
    caught.load_state_dict(resumed.state_dict())  # mid-check: the check is made again, at once
    assert step(caught) == 0 and caught.verdict == first.verdict
    fresh = make()
    fresh.load_state_dict(None)
    assert [step(fresh) for _ in range(2)] == [None, 0] and fresh.deciding  # without state: warm-up, then turns
