"""A prompt that extends an earlier generation reuses its caches; the output equals a cold run."""

import mlx.core as mx
import numpy as np
import pytest

from helpers.reference import plain_greedy
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import Speculator, generate
from speculative.events import Token
from speculative.prefix_cache import PrefixCache, PrefixEntry

TURNS = ["def add(a, b):\n", "\n# now subtract\n", "\n# and multiply\n"]


def run(lm, prompt, mode, n, cache=None, **kw):
    events = list(generate(lm, prompt, SamplingParams(max_tokens=n, **kw), SpecConfig(mode, 3),
                           prefix_cache=cache))
    return [e.id for e in events if isinstance(e, Token)], events[-1]


@pytest.mark.parametrize("mode", ["mtp", "off"])
def test_turns_reuse_the_previous_turn_and_match_cold_runs(tiny_lm, mode):
    lm = tiny_lm("untied-mha")
    cache = PrefixCache()
    prompt, reusable = [], 0
    for i, text in enumerate(TURNS):
        prompt = prompt + lm.tokenizer.encode(text)
        tokens, done = run(lm, prompt, mode, 12 + 5 * i, cache)
        assert tokens == run(lm, prompt, mode, 12 + 5 * i)[0] == plain_greedy(lm, prompt, 12 + 5 * i)
        assert done.reused_prompt_tokens == reusable
        # Speculative entries leave out the last emitted token: it was never fed to the trunk.
        reusable = len(prompt) + len(tokens) - (1 if mode == "mtp" else 0)
        prompt = prompt + tokens


def test_penalties_count_the_reused_prefix(tiny_lm):
    lm = tiny_lm()
    cache = PrefixCache()
    first = lm.tokenizer.encode(TURNS[0])
    tokens, _ = run(lm, first, "off", 10, cache, repetition_penalty=1.5, presence_penalty=1.0)
    prompt = first + tokens + lm.tokenizer.encode(TURNS[1])
    warm, done = run(lm, prompt, "off", 30, cache, repetition_penalty=1.5, presence_penalty=1.0)
    assert done.reused_prompt_tokens == len(first) + 10
    assert warm == run(lm, prompt, "off", 30, repetition_penalty=1.5, presence_penalty=1.0)[0]


class OracleSpeculator(Speculator):
    """Drafts the true continuation, so every round is fully accepted and stops land mid-round."""

    def __init__(self, *args, reference, **kw):
        super().__init__(*args, **kw)
        self.reference = reference

    def _draft(self, k):
        start = len(self.generated)
        return mx.array((self.reference + [0] * k)[start : start + k]), None


def assert_same_cache(got, want, what):
    """Attention KV: same offset and rows; Gated DeltaNet: same conv window and recurrent state."""
    if hasattr(want, "offset"):
        n = want.offset
        assert got.offset == n, what
        pairs = [(got.keys[..., :n, :], want.keys[..., :n, :]), (got.values[..., :n, :], want.values[..., :n, :])]
    else:
        pairs = [(got[0], want[0]), (got[1], want[1])]
    for a, b in pairs:
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4, err_msg=what)


def take_tokens(steps, n):
    """The first n token ids of a Speculator.run stream, then close it (as a consumer that stops)."""
    out = []
    while len(out) < n:
        e = next(steps)
        if isinstance(e, Token):
            out.append(e.id)
    steps.close()
    return out


@pytest.mark.parametrize("emitted", [1, 2, 4, 5, 6, 9])
def test_snapshot_settles_a_stop_inside_a_round(tiny_lm, emitted):
    """Depth 4: tokens 2..6 come from one round; stopping after any of them leaves the trunk ahead."""
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(TURNS[0])
    reference = plain_greedy(lm, prompt, 20, stop_at_eos=False)
    first = OracleSpeculator(lm, SamplingParams(max_tokens=20), 4, 2048, reference=reference)
    got = take_tokens(first.run(prompt), emitted)
    assert got == reference[:emitted]
    entry = first.snapshot(emitted)
    assert entry.tokens == tuple(prompt + got[:-1])
    assert entry.trunk_cache[3].offset == len(entry.tokens)  # layer 3 is full attention
    assert entry.head_cache[0].offset == len(entry.tokens) - 1

    follow = prompt + got + lm.tokenizer.encode(TURNS[1])
    warm, cold = (Speculator(lm, SamplingParams(max_tokens=25), 3, 2048) for _ in range(2))
    warm_steps, cold_steps = warm.run(follow, resume=entry), cold.run(follow)
    assert next(warm_steps) == next(cold_steps)  # both prefilled: their caches must agree
    for i, (w, c) in enumerate(zip(warm.trunk_cache + warm.head_cache, cold.trunk_cache + cold.head_cache)):
        assert_same_cache(w, c, f"layer {i}")
    tokens = [warm.generated[0]] + take_tokens(warm_steps, 24)
    assert tokens == plain_greedy(lm, follow, 25, stop_at_eos=False)


def test_cache_hands_out_the_longest_strict_prefix_once():
    cache = PrefixCache(capacity=3)
    short, long_, plain = (PrefixEntry((1, 2), [], head_cache=[]), PrefixEntry((1, 2, 3), [], head_cache=[]),
                           PrefixEntry((1, 2, 3, 4), []))
    for e in (short, long_, plain):
        cache.put(e)
    assert cache.take([1, 2, 3], with_head=True) is short  # strict: one token must remain to prefill
    assert cache.take([1, 2, 3, 4, 5], with_head=True) is long_  # `plain` has no head cache
    assert cache.take([1, 2, 3, 4, 5], with_head=True) is None  # each entry is handed out once
    assert cache.take([1, 2, 3, 4, 5], with_head=False) is plain
    for i in range(5):
        cache.put(PrefixEntry((9, i), []))
    assert [e.tokens for e in cache.entries] == [(9, 2), (9, 3), (9, 4)]
