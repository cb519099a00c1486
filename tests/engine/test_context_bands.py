"""Acceptance by context band and the share of rounds parked, from real rounds: each Round says the
context it ran at, each Parked a round a drafting row ran at depth 0, and GenerationStats' bands
add up to its totals (what /stats, /metrics and `dyno bench` report: tests/server/test_context_stats.py,
tests/engine/test_bench.py)."""

import random

import pytest

from helpers.reference import plain_greedy
from speculative.batched.decoding import Decoding, Request
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Parked, Round, Token
from speculative.round import depth_policy
from speculative.round.depth_policy import BatchCosts, DepthPolicy
from speculative.stats import CONTEXT_BANDS, GenerationStats, context_band

BANDS = [name for name, _ in CONTEXT_BANDS]


def folded(events) -> GenerationStats:
    stats = GenerationStats()
    for e in events:
        stats.add(e)
    return stats


def contexts(prompt, events):
    """Each Round's and Parked's context as the stream shows it: the prompt and the tokens before it."""
    out, n = [], len(prompt)
    for e in events:
        if isinstance(e, Token):
            n += 1
        elif isinstance(e, (Round, Parked)):
            out.append((e, n))
    return out


def assert_bands_add_up(stats):
    bands = stats.by_context_json()
    assert list(bands) == BANDS
    for key in ("rounds", "draft_tokens", "accepted_tokens", "parked_rounds"):
        assert sum(b[key] for b in bands.values()) == stats.speculative_json()[key]
    for i in range(len(stats.drafted_per_position)):
        assert sum(b["drafted_per_position"][i] for b in bands.values() if b["rounds"]) == stats.drafted_per_position[i]
        assert sum(b["accepted_per_position"][i] for b in bands.values() if b["rounds"]) == stats.accepted_per_position[i]


def test_context_bands_split_at_their_edges():
    assert [context_band(n) for n in (0, 2047, 2048, 8191, 8192, 32767, 32768, 10**6)] == [
        "under_2k", "under_2k", "2k_8k", "2k_8k", "8k_32k", "8k_32k", "over_32k", "over_32k"]


def test_rounds_crossing_2k_of_context_count_in_the_band_they_ran_at(tiny_lm):
    """A prompt just under 2048 tokens: the first rounds run under 2k, the later ones in 2-8k; each
    Round's context is the prompt and the tokens before it; the bands add up to the totals; the
    answer is still plain mlx-lm's."""
    lm = tiny_lm()
    prompt = random.Random(0).choices(range(256), k=2030)
    events = list(generate(lm, prompt, SamplingParams(max_tokens=40), SpecConfig("mtp", 3)))
    tokens = [e.id for e in events if isinstance(e, Token)]
    assert tokens == plain_greedy(lm, prompt, 40)
    seen = contexts(prompt, events)
    assert all(r.context == n for r, n in seen)
    stats = folded(events)
    under = sum(1 for r, n in seen if n < 2048)
    assert 0 < under < stats.rounds  # both sides of the edge ran
    assert stats.bands["under_2k"].rounds == under and stats.bands["2k_8k"].rounds == stats.rounds - under
    assert stats.parked_rounds == 0 and stats.parked_share == 0.0  # pinned at 3: never parked
    assert_bands_add_up(stats)
    band = stats.by_context_json()["2k_8k"]
    assert band["acceptance"] == pytest.approx(band["accepted_tokens"] / band["draft_tokens"])
    assert stats.by_context_json()["8k_32k"] == {
        "rounds": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": [],
        "drafted_per_position": [], "tokens_per_round": None, "acceptance_by_position": [], "acceptance": None,
        "parked_rounds": 0, "parked_share": None}


def test_rounds_the_policy_runs_at_depth_0_are_parked(tiny_lm, monkeypatch):
    """A policy whose costs make drafting lose parks the row (depth 0) but for its exploring turns:
    every round the policy chose at 0 is one Parked, every other a Round; the answer is unchanged."""
    monkeypatch.setattr(depth_policy, "EXPLORE_EVERY", 8)  # an exploring turn (3 rounds at depth 1) every 8
    lm = tiny_lm()
    costs = BatchCosts({1: {1: 1.0, 2: 10.0, 3: 10.0, 4: 10.0}}, {1: 0.01})
    policy = DepthPolicy(costs, [0.9, 0.9, 0.9], max_depth=3)
    decoding = Decoding(lm, SpecConfig("mtp", 3), policy=policy)
    prompt = random.Random(1).choices(range(256), k=2100)
    out = decoding.join_one(Request("r", prompt, SamplingParams(max_tokens=40)))
    events = list(out.events)
    while out.finish is None:
        out = decoding.step()["r"]
        events += out.events
    n = sum(isinstance(e, Token) for e in events)
    events.append(decoding.finish("r", n, out.finish))
    assert [e.id for e in events if isinstance(e, Token)] == plain_greedy(lm, prompt, 40)
    stats = folded(events)
    chosen = policy.chosen[1]
    assert stats.parked_rounds == chosen[0] > 0 and stats.rounds == sum(v for k, v in chosen.items() if k) > 0
    assert stats.parked_share == pytest.approx(chosen[0] / sum(chosen.values()))
    assert all(p.context == n for p, n in contexts(prompt, events))
    assert stats.bands["2k_8k"].parked_rounds == stats.parked_rounds  # a 2100-token prompt: all in 2-8k
    assert stats.by_context_json()["2k_8k"]["parked_share"] == stats.parked_share
    assert_bands_add_up(stats)
    merged = GenerationStats()
    merged.merge(stats)
    merged.merge(stats)
    assert (merged.parked_rounds, merged.bands["2k_8k"].rounds) == (2 * stats.parked_rounds, 2 * stats.rounds)


def test_a_row_pinned_at_depth_0_is_never_parked(tiny_lm):
    lm = tiny_lm()
    decoding = Decoding(lm, SpecConfig("mtp", 3))
    prompt = random.Random(2).choices(range(256), k=50)
    out = decoding.join_one(Request("r", prompt, SamplingParams(max_tokens=12), depth=0))
    events = list(out.events)
    while out.finish is None:
        out = decoding.step()["r"]
        events += out.events
    assert not [e for e in events if isinstance(e, (Round, Parked))]
    assert [e.id for e in events if isinstance(e, Token)] == plain_greedy(lm, prompt, 12)
