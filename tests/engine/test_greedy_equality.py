"""Speculative greedy output is mlx-lm's greedy output, token for token, and every round keeps
exactly the drafts the greedy rule keeps: the longest prefix that agrees with plain greedy."""

import random

import pytest
import mlx.core as mx

from helpers.drafts import drafted, recording_drafter, replay
from helpers.reference import plain_greedy_prefix
from helpers.tiny_models import CONFIGS
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.round.drafter import Drafts
from speculative.events import Provenance, Round, Token

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def run(lm, prompt, depth, n=200, prefill_step=2048, drafter=None):
    events = list(generate(lm, prompt, SamplingParams(max_tokens=n), SpecConfig("mtp", depth),
                           prefill_step=prefill_step, drafter=drafter))
    return [e for e in events if isinstance(e, Token)], [e for e in events if isinstance(e, Round)]


def provenance(kept, depth):
    """Each token's provenance when the rounds keep `kept` drafts: the prefill token, then per round
    its kept drafts and the correction (or, when all were kept, the bonus)."""
    out = [Provenance.PLAIN]
    for a in kept:
        out += [Provenance.DRAFT] * a + [Provenance.BONUS if a == depth else Provenance.CORRECTION]
    return out


CASES = [(name, depth) for name in CONFIGS for depth in (1, 2, 3, 4, 5)
         if not (name.startswith("moe") and depth == 5)]  # MoE: depths 1..4
LONGEST = 200 + 5  # each model's one reference run: every depth's case (and look-ahead) reads its prefix


@pytest.mark.parametrize("name, depth", CASES)
def test_greedy_equals_mlx_lm(tiny_lm, name, depth):
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode(PROMPT)
    drafts = []
    tokens, rounds = run(lm, prompt, depth, drafter=recording_drafter(drafts))
    reference = plain_greedy_prefix(lm, prompt, LONGEST, stop_at_eos=False)[: 200 + depth]  # the last round looks ahead
    assert [t.id for t in tokens] == reference[:200]
    # Exact accounting: one round per draft, each keeping what the rule replayed on its drafts keeps
    # (an engine that threw away a draft greedy agrees with would still emit the same text).
    drafts = [d.tolist() for d in drafts]
    kept = replay(drafts, reference, 200)
    assert len(drafts) == len(rounds) == len(kept) and all(len(d) == depth for d in drafts)
    assert [(r.drafted, r.accepted) for r in rounds] == [(depth, a) for a in kept]
    assert [t.provenance for t in tokens] == provenance(kept, depth)[:200]


@pytest.mark.parametrize("depth", [2, 4])
def test_prompt_longer_than_prefill_chunk(tiny_lm, depth):
    lm = tiny_lm("untied-mha")
    prompt = lm.tokenizer.encode(PROMPT * 3)  # ~150 tokens, chunks of 32
    assert len(prompt) > 3 * 32
    tokens, _ = run(lm, prompt, depth, n=120, prefill_step=32)
    assert [t.id for t in tokens] == plain_greedy_prefix(lm, prompt, 120, prefill_step=32)


def test_off_mode_is_plain_mlx_lm(tiny_lm):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(PROMPT)
    events = list(generate(lm, prompt, SamplingParams(max_tokens=50), SpecConfig("off")))
    tokens = [e for e in events if isinstance(e, Token)]
    assert [t.id for t in tokens] == plain_greedy_prefix(lm, prompt, 50)
    assert not any(isinstance(e, Round) for e in events)
    assert {t.provenance for t in tokens} == {Provenance.PLAIN}


class ScriptedDrafter:
    """Drafts from a known continuation, each draft right or off by one as `right()` says, so that
    how many each round keeps is known before the trunk sees it: the leading run of right ones."""

    def __init__(self, reference, right, vocab):
        self.reference, self.right, self.vocab, self.script = reference, right, vocab, []

    def propose(self, rounds, budgets):
        (row,), (k,) = rounds.rows, budgets
        start = len(row.generated)
        ref = (self.reference + [0] * k)[start : start + k]
        flags = [self.right() for _ in ref]
        self.script.append(flags)
        return Drafts(mx.array([[t if ok else (t + 1) % self.vocab for t, ok in zip(ref, flags)]]), [None], [k])


def leading_right(flags):
    return next((i for i, ok in enumerate(flags) if not ok), len(flags))


SCRIPTS = {"oracle": lambda rng: True, "adversarial": lambda rng: False,
           "coin": lambda rng: rng.random() < 0.6}  # each draft right with probability 0.6


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripted_heads_keep_exactly_their_right_prefix(tiny_lm, script):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(PROMPT)
    reference = plain_greedy_prefix(lm, prompt, 121, stop_at_eos=False)
    depth, rng = 4, random.Random(0)
    drafter = ScriptedDrafter(reference, lambda: SCRIPTS[script](rng), lm.vocab_size)
    steps = drafted(lm, SamplingParams(max_tokens=121), depth, drafter=drafter).run(prompt)
    tokens, rounds = [], []
    while len(tokens) < 121:
        e = next(steps)
        (rounds if isinstance(e, Round) else tokens).append(e)
    assert [t.id for t in tokens[:121]] == reference
    kept = [leading_right(flags) for flags in drafter.script]
    assert [(r.drafted, r.accepted) for r in rounds] == [(depth, a) for a in kept]
    assert [t.provenance for t in tokens] == provenance(kept, depth)[: len(tokens)]
    assert sum(a + 1 for a in kept[:-1]) + 1 < 121 <= sum(a + 1 for a in kept) + 1  # no round too many
    if script == "oracle":
        assert len(rounds) == 24  # 1 prefill token + 24 rounds x (4 drafts + bonus) = 121
    elif script == "adversarial":
        assert len(rounds) == 120  # one correction per round
    else:
        assert set(kept) == {0, 1, 2, 3, 4}  # every acceptance length occurred
