"""Speculative greedy output is mlx-lm's greedy output, token for token."""

import pytest
import mlx.core as mx

from conftest import CONFIGS, plain_greedy
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import Speculator, generate
from speculative.events import Provenance, Round, Token

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def run(lm, prompt, depth, n=200, prefill_step=2048, speculator=None):
    events = list(generate(lm, prompt, SamplingParams(max_tokens=n), SpecConfig("mtp", depth),
                           prefill_step=prefill_step))
    return [e for e in events if isinstance(e, Token)], [e for e in events if isinstance(e, Round)]


CASES = [(name, depth) for name in CONFIGS for depth in (1, 2, 3, 4, 5)
         if not (name.startswith("moe") and depth == 5)]  # MoE: depths 1..4


@pytest.mark.parametrize("name, depth", CASES)
def test_greedy_equals_mlx_lm(tiny_lm, name, depth):
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode(PROMPT)
    tokens, rounds = run(lm, prompt, depth)
    assert len(tokens) == 200
    assert [t.id for t in tokens] == plain_greedy(lm, prompt, 200)
    # Every token after the first comes from a verified round (the last may be cut by max_tokens).
    produced = sum(r.accepted + 1 for r in rounds)
    assert len(tokens) - 1 <= produced < len(tokens) + depth
    drafted = [t for t in tokens if t.provenance is Provenance.DRAFT]
    assert len(drafted) <= sum(r.accepted for r in rounds)
    assert all(r.drafted == depth for r in rounds)


@pytest.mark.parametrize("depth", [2, 4])
def test_prompt_longer_than_prefill_chunk(tiny_lm, depth):
    lm = tiny_lm("untied-mha")
    prompt = lm.tokenizer.encode(PROMPT * 3)  # ~150 tokens, chunks of 32
    assert len(prompt) > 3 * 32
    tokens, _ = run(lm, prompt, depth, n=120, prefill_step=32)
    assert [t.id for t in tokens] == plain_greedy(lm, prompt, 120, prefill_step=32)


def test_off_mode_is_plain_mlx_lm(tiny_lm):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(PROMPT)
    events = list(generate(lm, prompt, SamplingParams(max_tokens=50), SpecConfig("off")))
    tokens = [e for e in events if isinstance(e, Token)]
    assert [t.id for t in tokens] == plain_greedy(lm, prompt, 50)
    assert not any(isinstance(e, Round) for e in events)
    assert {t.provenance for t in tokens} == {Provenance.PLAIN}


class ScriptedSpeculator(Speculator):
    """Drafts from a known continuation: right (oracle) or always wrong (adversarial)."""

    def __init__(self, *args, reference, wrong=False, **kw):
        super().__init__(*args, **kw)
        self.reference, self.wrong = reference, wrong

    def _draft(self, k):
        start = len(self.generated)
        ref = (self.reference + [0] * k)[start : start + k]
        vocab = self.target.args.vocab_size
        return mx.array([(t + 1) % vocab if self.wrong else t for t in ref]), None


@pytest.mark.parametrize("wrong", [False, True], ids=["oracle", "adversarial"])
def test_oracle_accepts_all_adversary_none(tiny_lm, wrong):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(PROMPT)
    reference = plain_greedy(lm, prompt, 121, stop_at_eos=False)
    depth = 4
    spec = ScriptedSpeculator(lm, SamplingParams(max_tokens=121), depth, 2048, reference=reference,
                              wrong=wrong)
    steps = spec.run(prompt)
    tokens, rounds = [], []
    while len(tokens) < 121:
        e = next(steps)
        (rounds if isinstance(e, Round) else tokens).append(e)
    assert [t.id for t in tokens[:121]] == reference
    if wrong:
        assert all(r.accepted == 0 for r in rounds)
        assert {t.provenance for t in tokens[1:]} == {Provenance.CORRECTION}
    else:
        assert all(r.accepted == depth for r in rounds)
        assert len(rounds) == 24  # 1 prefill token + 24 rounds x (4 drafts + bonus) = 121
        kinds = [t.provenance for t in tokens[1:6]]
        assert kinds == [Provenance.DRAFT] * 4 + [Provenance.BONUS]
