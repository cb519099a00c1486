"""The batched depth policy: with hand-made V, D and acceptance it picks the hand-computed depth."""

import json
import random
import statistics
from types import SimpleNamespace

import pytest

import speculative.depth as deciding
from speculative.config import MAX_DRAFT_DEPTH
from speculative.events import Provenance, Round, Token
from speculative.measure import tuning
from speculative.measure.batch_cost import measure_batch_costs, monotone
from speculative.round import depth_policy
from speculative.round.depth_policy import BatchCosts, DepthPolicy

ACCEPTANCE = [0.9, 0.8, 0.7]  # E(k) = 1, 1.9, 2.7, 3.4
COSTS = BatchCosts(
    verify={1: {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3},
            2: {1: 1.0, 2: 1.5, 3: 1.8, 4: 2.2},
            8: {1: 2.0, 2: 4.0, 3: 6.0, 4: 8.0}},
    draft={1: 0.1, 2: 0.2, 8: 0.4})


def best_depth(costs, acceptance, width, max_depth):
    """The depth a policy picks before it has timed any round: the tuned costs' best."""
    return DepthPolicy(costs, acceptance, max_depth=max_depth).best_depth(width)


def test_the_depth_with_the_most_tokens_per_second():
    # Width 1: 1/1, 1.9/1.2, 2.7/1.4, 3.4/1.6 = 1, 1.58, 1.93, 2.125.
    assert best_depth(COSTS, ACCEPTANCE, 1, 4) == 3
    # Width 2: 2/1, 3.8/1.7, 5.4/2.2, 6.8/2.8 = 2, 2.235, 2.45, 2.43.
    assert best_depth(COSTS, ACCEPTANCE, 2, 4) == 2
    # Width 8: 8/2, 15.2/4.4, 21.6/6.8, 27.2/9.2 = 4, 3.45, 3.18, 2.96: drafting cannot pay.
    assert best_depth(COSTS, ACCEPTANCE, 8, 4) == 0
    assert best_depth(COSTS, ACCEPTANCE, 1, 1) == 1  # no deeper than allowed


def test_unmeasured_widths_are_interpolated():
    # Width 5, halfway between 2 and 8: V = 1.5, 2.75, 3.9, 5.1, D = 0.3;
    # 5/1.5, 9.5/3.05, 13.5/4.5, 17/6.0 = 3.33, 3.11, 3.0, 2.83.
    assert COSTS.V(5, 3) == pytest.approx(3.9) and COSTS.D(5) == pytest.approx(0.3)
    assert best_depth(COSTS, ACCEPTANCE, 5, 4) == 0
    assert COSTS.V(14, 1) == pytest.approx(3.0)  # beyond 8: along the last two widths
    assert COSTS.max_depth == 3


def test_the_policy_starts_from_the_prior_and_learns_from_rounds():
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=3)
    assert policy.acceptance() == pytest.approx(ACCEPTANCE)
    assert [policy.depth_for(w) for w in (1, 2, 8)] == [3, 2, 0]
    policy.observe([Round(3, 2), Token(5, Provenance.DRAFT), Round(0, 0)])  # tokens and undrafted rounds: ignored
    p = depth_policy.PRIOR_ROUNDS
    assert policy.acceptance() == pytest.approx([(1 + p * 0.9) / (1 + p), (1 + p * 0.8) / (1 + p), p * 0.7 / (1 + p)])
    for _ in range(100):  # the head stops being right: the first draft is always rejected
        policy.observe([Round(3, 0), Round(3, 0)])
    assert policy.acceptance()[0] < 0.1
    assert policy.depth_for(1) == 0  # 1 + a < 1.2 (V(1, 2) + D): drafting no longer pays alone either
    assert policy.chosen == {1: {3: 1, 0: 1}, 2: {2: 1}, 8: {0: 1}}


def test_a_pinned_depth_is_the_depth():
    assert DepthPolicy(None, [], pinned=2).depth_for(8) == 2
    assert DepthPolicy(COSTS, ACCEPTANCE, pinned=1).depth_for(8) == 1
    with pytest.raises(ValueError):
        DepthPolicy(None, ACCEPTANCE)


def test_costs_are_made_monotone_and_round_trip_through_json():
    noisy = BatchCosts({1: {1: 1.0, 2: 0.9, 3: 1.5}, 2: {1: 0.8, 2: -0.1, 3: 2.0}}, {1: 0.2, 2: 0.1})
    fixed = monotone(noisy)
    assert fixed.verify == {1: {1: 1.0, 2: 1.0, 3: 1.5}, 2: {1: 1.0, 2: 1.0, 3: 2.0}}
    assert fixed.draft == {1: 0.2, 2: 0.2}
    again = BatchCosts.from_json(json.loads(json.dumps(fixed.as_json())))
    assert again.verify == fixed.verify and again.draft == fixed.draft


def test_measured_costs_cover_each_width_and_depth(tiny_lm):
    lm = tiny_lm()
    costs = measure_batch_costs(lm, lm.tokenizer.encode("def f(x):\n"), widths=(1, 2), max_depth=2, reps=1)
    assert sorted(costs.verify) == [1, 2] and all(sorted(r) == [1, 2, 3] for r in costs.verify.values())
    assert all(v > 0 for r in costs.verify.values() for v in r.values()) and all(d > 0 for d in costs.draft.values())
    assert sorted(costs.rounds) == [1, 2] and all(sorted(r) == [0, 1, 2] for r in costs.rounds.values())
    assert all(s > 0 for r in costs.rounds.values() for s in r.values())
    assert costs.round(2, 1) == costs.rounds[2][1]  # whole rounds, where measured, are the round's cost


def test_whole_rounds_where_measured_else_verify_and_draft():
    with_rounds = BatchCosts(COSTS.verify, COSTS.draft, {1: {0: 2.0, 1: 3.0}, 8: {0: 4.0, 1: 9.0}})
    assert with_rounds.round(1, 1) == 3.0 and with_rounds.round(4, 1) == pytest.approx(5.571428, rel=1e-5)
    assert with_rounds.round(1, 2) == pytest.approx(1.2 + 2 * 0.1)  # depth 2 was not run whole
    assert COSTS.round(2, 2) == pytest.approx(1.8 + 2 * 0.2)
    again = BatchCosts.from_json(json.loads(json.dumps(with_rounds.as_json())))
    assert again.rounds == with_rounds.rounds and "R" not in COSTS.as_json()
    assert monotone(BatchCosts(COSTS.verify, COSTS.draft, {1: {0: 2.0, 1: 1.0}, 2: {0: 1.5, 1: 4.0}})).rounds == {
        1: {0: 2.0, 1: 2.0}, 2: {0: 2.0, 1: 4.0}}


def test_a_timing_noise_made_non_positive_is_timed_again_alone(tiny_lm, monkeypatch):
    from speculative.measure import cost_model

    # Under load the longer burst can finish sooner than the shorter: a difference at or below zero.
    monkeypatch.setattr(cost_model, "per_call", lambda build, burst: -0.001)
    lm = tiny_lm()
    prompt = lm.tokenizer.encode("def f(x):\n")
    costs = measure_batch_costs(lm, prompt, widths=(1,), max_depth=1, reps=1)
    assert costs.verify[1][1] > 0 and costs.draft[1] > 0
    single = cost_model.cost_model(lm, prompt, [1], reps=1)
    assert single["T1"] > 0 and single["Td"] > 0 and single["Tv"][1] > 0


def test_auto_uses_the_stored_costs(monkeypatch, tmp_path):
    """`--draft-depth auto` in a batched server reads what `dyno tune` stored (nothing is measured)."""
    monkeypatch.setenv("DYNO_CACHE", str(tmp_path))
    lm = SimpleNamespace(path=tmp_path / "model", head=object())
    tuning.store(lm, 2, {"source": "measured", "acceptance": ACCEPTANCE, "batch_costs": COSTS.as_json()}, None)
    monkeypatch.setattr(deciding, "measure_batch_costs", None)  # calling it would fail
    policy = deciding.batched_policy(lm, "auto")
    assert policy.acceptance() == pytest.approx(ACCEPTANCE + [0.0] * (MAX_DRAFT_DEPTH - len(ACCEPTANCE)))
    # One row: the single-request engine's stored depth (the costs alone would say 3).
    assert [policy.depth_for(w) for w in (1, 2, 8)] == [2, 2, 0] and policy.best_depth(1) == 3
    assert deciding.batched_policy(lm, 1).depth_for(1) == 1


def test_one_row_drafts_at_the_single_request_depth_without_exploring():
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=3, single=1)
    assert {policy.depth_for(1) for _ in range(3 * depth_policy.EXPLORE_EVERY)} == {1}
    assert len({policy.depth_for(2) for _ in range(3 * depth_policy.EXPLORE_EVERY)}) > 1  # wider: explored
    assert DepthPolicy(COSTS, ACCEPTANCE, max_depth=1, single=3).depth_for(1) == 1  # within what rows hold


def test_timed_rounds_overrule_the_tuned_costs():
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=3)
    assert policy.depth_for(1) == 3
    policy.record(1, 3, 10.0)  # the first round at a depth pays the switch: not a time yet
    assert policy.clock.seconds(1, 3) == pytest.approx(COSTS.V(1, 4) + 3 * COSTS.D(1))
    policy.record(1, 3, 10.0)
    policy.record(1, 0, 1.0)
    policy.record(1, 0, 1.0)
    # Depth 3 delivers 3.4 / 10; depth 0 1 / 1; depths 1 and 2, not timed, are the tuned costs times
    # the median measured/tuned ratio at this width, (10 / 1.6 + 1 / 1) / 2 = 3.625: 1.9 / 4.35, 2.7 / 5.075.
    assert policy.clock.seconds(1, 2) == pytest.approx(1.4 * 3.625)
    assert policy.depth_for(1) == 0
    # A width with no timed round scales its tuned costs by every width's ratios.
    assert policy.clock.seconds(2, 1) == pytest.approx(1.7 * 3.625)


def test_a_slow_spell_does_not_make_the_depths_not_in_use_look_cheap():
    """Depth 0 takes 1 s and depth 1 2.1 s (1 / 1 against 1.9 / 2.1): 0 is best. Then the machine slows
    by half for a while: depth 0's rounds take 1.5 s, and depth 1, not run, keeps its old times."""
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=1)
    for depth, seconds in [(1, 2.1)] * 12 + [(0, 1.0)] * 12:
        policy.record(1, depth, seconds)
    assert policy.depth_for(1) == 0
    for _ in range(3 * depth_policy.WINDOW):
        policy.record(1, 0, 1.5)
    assert policy.clock.speed == pytest.approx(1.5, rel=0.01)
    assert policy.clock.seconds(1, 1) == pytest.approx(1.5 * 2.1, rel=0.01)  # what depth 1 would take now
    assert policy.best_depth(1) == 0


def test_the_speed_estimate_does_not_wander_with_noise():
    """Rounds of constant true cost with 8% noise, thousands of them: what the depth in use takes, and
    what a depth timed only at the start would take now, stay where they are."""
    rng = random.Random(0)
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=1)
    for _ in range(12):
        policy.record(1, 1, 2.0 * rng.gauss(1, 0.08))
    seen = []
    for i in range(5000):
        policy.record(1, 0, 1.0 * rng.gauss(1, 0.08))
        if i > 20:
            seen.append((policy.clock.seconds(1, 0), policy.clock.seconds(1, 1)))
    early, late = seen[:500], seen[-500:]
    for i, true in ((0, 1.0), (1, 2.0)):  # no drift: the means early and late agree, and with the truth
        assert statistics.mean(x[i] for x in early) == pytest.approx(true, rel=0.06)
        assert statistics.mean(x[i] for x in late) == pytest.approx(statistics.mean(x[i] for x in early), rel=0.03)


def test_one_slow_round_moves_the_estimate_little():
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=3)
    for s in [1.0] * 6 + [50.0] + [1.0] * 2:
        policy.record(2, 1, s)
    assert policy.clock.seconds(2, 1) == 1.0  # the median of the last rounds
    for _ in range(depth_policy.WINDOW):  # a lasting change takes over within a window
        policy.record(2, 1, 3.0)
    assert policy.clock.seconds(2, 1) == 3.0


def test_a_deeper_depth_must_beat_the_shallower_by_the_margin():
    """Timed rounds at 2 rows put depth 1 3% above depth 0 (1.9 / 1.845 against 1 / 1): within the
    margin, so plain rounds; at 10% above, depth 1."""
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=1)
    for depth, seconds in [(0, 1.0)] * 3 + [(1, 1.845)] * 3:
        policy.record(2, depth, seconds)
    rates = policy.expected_rates(2)
    assert rates[1] / rates[0] == pytest.approx(1.03, abs=0.001) and policy.best_depth(2) == 0
    for _ in range(depth_policy.WINDOW):
        policy.record(2, 1, 1.9 / 1.1)
    assert policy.expected_rates(2)[1] / rates[0] == pytest.approx(1.1, abs=0.02) and policy.best_depth(2) == 1


def test_exploring_neighbours_finds_the_depth_the_tuned_costs_missed():
    """The machine's true round times make depth 1 best (1.9 / 1.8 against 2.7 / 2.6, 3.4 / 3.4 and
    1 / 1) where the tuned ones say 3; timing a neighbour every EXPLORE_EVERY rounds walks there."""
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=3)
    true_seconds = lambda k: 1.0 + 0.8 * k  # noqa: E731
    picked = []
    for _ in range(8 * depth_policy.EXPLORE_EVERY):
        k = policy.depth_for(1)
        policy.record(1, k, true_seconds(k))
        picked.append(k)
    assert picked[0] == 3 and policy.best_depth(1) == 1
    last = picked[-2 * depth_policy.EXPLORE_EVERY:]  # settled: depth 1 but for the neighbours' timed rounds
    assert last.count(1) == len(last) - 2 * depth_policy.EXPLORE_RUN
    assert sorted(set(last)) == [0, 1, 2]


def test_a_neighbour_far_below_the_best_is_timed_rarely():
    """At 8 rows depth 1 delivers 1.9 / 3 s against depth 0's 1 / 1 s (0.63 of it): past its first
    FAR_EVIDENCE turns it is timed only once the rounds since its last turn make what a turn loses
    (its rounds at its rate, and one more for the switches) at most EXPLORE_BUDGET of their time; once
    acceptance makes it competitive, depth 0 (now the neighbour, and close) is timed on every turn."""
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=1)
    true_seconds = {0: 1.0, 1: 3.0}
    picked = []
    for _ in range(45 * depth_policy.EXPLORE_EVERY):
        k = policy.depth_for(8)
        policy.record(8, k, true_seconds[k], policy.peek(8))  # a turn's middle round alone is kept
        picked.append(k)
    assert policy.best_depth(8) == 0
    turns = sorted({n // depth_policy.EXPLORE_EVERY for n, k in enumerate(picked, 1) if k == 1})
    assert depth_policy.FAR_EVIDENCE == 3 and turns[:3] == [0, 1, 2]  # one timed round a turn at first
    later = turns[3:]
    assert len(later) == 2 and later[0] - 2 == later[1] - later[0] >= 10  # then rarely, evenly
    loss = (depth_policy.EXPLORE_RUN + 1) * 3.0 * (1 - 1.9 / 3.0)  # a turn's, in seconds
    spacing = later[1] - later[0]
    assert loss <= depth_policy.EXPLORE_BUDGET * spacing * depth_policy.EXPLORE_EVERY * 1.0
    assert loss > depth_policy.EXPLORE_BUDGET * (spacing - 1) * depth_policy.EXPLORE_EVERY * 1.0
    true_seconds[1] = 1.8  # 1.9 / 1.8: now depth 1 is best, and depth 0 close below it
    policy.record(8, 1, 1.8)
    for _ in range(depth_policy.WINDOW):
        policy.record(8, 1, 1.8)
    picked = [policy.depth_for(8) for _ in range(4 * depth_policy.EXPLORE_EVERY)]
    assert policy.best_depth(8) == 1 and picked.count(0) == 4 * depth_policy.EXPLORE_RUN


def test_peek_is_the_next_depth_without_counting_it():
    """What a round queues work for: the depth the next depth_for gives, exploration turns included."""
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=3)
    for _ in range(3 * depth_policy.EXPLORE_EVERY):
        expected = policy.peek(2)
        assert policy.peek(2) == expected  # peeking counts nothing
        assert policy.depth_for(2) == expected
    assert len(set(sum(([k] * n for k, n in policy.chosen[2].items()), []))) > 1  # turns were explored


def test_an_explored_depth_is_timed_on_its_steady_round_alone():
    """An exploration turn enters a depth (paying the switch), runs it, and leaves it (queueing the
    next depth's work, which MLX's CPU backend partly runs inside that round): only the middle
    round's time is kept, so the explored depth is not charged for either switch."""
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=1)
    steady = {0: 1.0, 1: 2.0}
    for _ in range(6 * depth_policy.EXPLORE_EVERY):
        k, then = policy.depth_for(8), policy.peek(8)
        switch = 1.5 if (k != then or policy.clock.last != (8, k)) else 0.0
        policy.record(8, k, steady[k] + switch, then)
    assert policy.clock.seconds(8, 1) == pytest.approx(2.0)
    assert policy.clock.seconds(8, 0) == pytest.approx(1.0)


def test_a_pinned_policy_ignores_round_times():
    policy = DepthPolicy(None, [], pinned=2)
    policy.record(1, 2, 100.0)
    assert policy.clock is None and policy.best_depth(1) == 2
    assert [policy.depth_for(1) for _ in range(3 * depth_policy.EXPLORE_EVERY)] == [2] * 3 * depth_policy.EXPLORE_EVERY


def test_a_round_is_timed_from_its_start_to_the_next_unless_skipped(monkeypatch):
    recorded = []
    timer = depth_policy.RoundTimer(lambda *a: recorded.append(a))
    clock = iter([1.0, 3.5, 4.0, 10.0])
    monkeypatch.setattr(depth_policy.time, "perf_counter", lambda: next(clock))
    timer.start(2, 1, 1)  # t = 1
    timer.start(2, 1, 0)  # t = 3.5: the first round took 2.5 s, host work after its step included
    timer.skip()  # a row's prefill
    timer.start(3, 0)  # t = 4: the round before the prefill is not timed
    timer.start(3, 0)  # t = 10
    assert recorded == [(2, 1, 2.5, 1), (3, 0, 6.0, None)]
