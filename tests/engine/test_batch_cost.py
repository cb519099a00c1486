"""The batched depth policy: with hand-made V, D and acceptance it picks the hand-computed depth."""

import json
from types import SimpleNamespace

import pytest

from speculative.events import Provenance, Round, Token
from speculative.measure import batch_cost, tuning
from speculative.measure.batch_cost import BatchCosts, DepthPolicy, best_depth, measure_batch_costs, monotone

ACCEPTANCE = [0.9, 0.8, 0.7]  # E(k) = 1, 1.9, 2.7, 3.4
COSTS = BatchCosts(
    verify={1: {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3},
            2: {1: 1.0, 2: 1.4, 3: 1.8, 4: 2.2},
            8: {1: 2.0, 2: 4.0, 3: 6.0, 4: 8.0}},
    draft={1: 0.1, 2: 0.2, 8: 0.4})


def test_the_depth_with_the_most_tokens_per_second():
    # Width 1: 1/1, 1.9/1.2, 2.7/1.4, 3.4/1.6 = 1, 1.58, 1.93, 2.125.
    assert best_depth(COSTS, ACCEPTANCE, 1, 4) == 3
    # Width 2: 2/1, 3.8/1.6, 5.4/2.2, 6.8/2.8 = 2, 2.375, 2.45, 2.43.
    assert best_depth(COSTS, ACCEPTANCE, 2, 4) == 2
    # Width 8: 8/2, 15.2/4.4, 21.6/6.8, 27.2/9.2 = 4, 3.45, 3.18, 2.96: drafting cannot pay.
    assert best_depth(COSTS, ACCEPTANCE, 8, 4) == 0
    assert best_depth(COSTS, ACCEPTANCE, 1, 1) == 1  # no deeper than allowed


def test_unmeasured_widths_are_interpolated():
    # Width 5, halfway between 2 and 8: V = 1.5, 2.7, 3.9, 5.1, D = 0.3;
    # 5/1.5, 9.5/3.0, 13.5/4.5, 17/6.0 = 3.33, 3.17, 3.0, 2.83.
    assert COSTS.V(5, 3) == pytest.approx(3.9) and COSTS.D(5) == pytest.approx(0.3)
    assert best_depth(COSTS, ACCEPTANCE, 5, 4) == 0
    assert COSTS.V(14, 1) == pytest.approx(3.0)  # beyond 8: along the last two widths
    assert COSTS.max_depth == 3


def test_the_policy_starts_from_the_prior_and_learns_from_rounds():
    policy = DepthPolicy(COSTS, ACCEPTANCE, max_depth=3)
    assert policy.acceptance() == pytest.approx(ACCEPTANCE)
    assert [policy.depth_for(w) for w in (1, 2, 8)] == [3, 2, 0]
    policy.observe([Round(3, 2), Token(5, Provenance.DRAFT), Round(0, 0)])  # tokens and undrafted rounds: ignored
    p = batch_cost.PRIOR_ROUNDS
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
    # Medians of 3: one timing is a difference of two runs, and a busy machine (CI's two cores, both
    # running tests) can make a single one come out at or below zero.
    costs = measure_batch_costs(lm, lm.tokenizer.encode("def f(x):\n"), widths=(1, 2), max_depth=2, reps=3)
    assert sorted(costs.verify) == [1, 2] and all(sorted(r) == [1, 2, 3] for r in costs.verify.values())
    assert all(v > 0 for r in costs.verify.values() for v in r.values()) and all(d > 0 for d in costs.draft.values())


def test_auto_uses_the_stored_costs(monkeypatch, tmp_path):
    """`--draft-depth auto` in a batched server reads what `dyno tune` stored (nothing is measured)."""
    monkeypatch.setenv("DYNO_CACHE", str(tmp_path))
    lm = SimpleNamespace(path=tmp_path / "model", head=object())
    tuning.store(lm, 3, {"source": "measured", "acceptance": ACCEPTANCE, "batch_costs": COSTS.as_json()}, None)
    monkeypatch.setattr(batch_cost, "measure_batch_costs", None)  # calling it would fail
    policy = batch_cost.resolve_policy(lm, "auto")
    assert policy.acceptance() == pytest.approx(ACCEPTANCE + [0.0])
    assert [policy.depth_for(w) for w in (1, 2, 8)] == [3, 2, 0]
    assert batch_cost.resolve_policy(lm, 2).depth_for(1) == 2
