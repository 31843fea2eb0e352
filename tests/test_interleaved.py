"""Choices on real steps: arms take turns, the switch step is left out, and a candidate replaces
the default only when it wins by more than the measured noise (checked on synthetic step times
with known noise, against closed forms)."""

from __future__ import annotations

import random

import pytest

from commsched.interleaved import MIN_MARGIN, Turns, decide, relative_spread


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
    verdict = decide([noisy(1.0, 9), noisy(0.8, 9)])
    assert verdict.keep == 1 and verdict.gain == pytest.approx(1.25, rel=0.05)
    tie = decide([noisy(1.0, 9), noisy(1.0, 9)])
    assert tie.keep == 0 and tie.gain == 1.0


def test_a_gain_inside_the_noise_is_not_taken():
    """5% faster under 10% noise with 9 steps an arm: the margin is about 2 x 1.2533 x sqrt(2/9) x 0.1 = 12%."""
    rng = random.Random(1)
    default = [1.0 * (1 + rng.gauss(0, 0.1)) for _ in range(9)]
    candidate = [0.95 * (1 + rng.gauss(0, 0.1)) for _ in range(9)]
    verdict = decide([default, candidate])
    assert verdict.margin > 0.08
    assert verdict.keep == 0


def test_a_quiet_machine_still_needs_the_minimum_margin():
    verdict = decide([[1.0] * 5, [1.0 - MIN_MARGIN / 2] * 5])
    assert verdict.margin == MIN_MARGIN and verdict.keep == 0
    assert decide([[1.0] * 5, [0.9] * 5, [0.95] * 5]).keep == 1  # the fastest candidate, when it clears the margin
