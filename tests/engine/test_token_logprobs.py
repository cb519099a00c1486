"""Per-token log-probabilities (SamplingParams.logprobs): the same with drafting on and off, equal
to the log-probabilities mlx-lm's generate_step yields, and absent unless asked for."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.errors import DynoError
from speculative.events import Token
from speculative.round.processors import processors_for

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
N = 40
# Verify rows are computed in one batch of k + 1 positions, plain decoding one position at a time:
# the same math in a different reduction order, so float32 values agree to rounding, not bit for bit.
TOL = 1e-4


def tokens(lm, prompt, params, mode, depth=3):
    return [e for e in generate(lm, prompt, params, SpecConfig(mode, depth)) if isinstance(e, Token)]


def reference(lm, prompt, params):
    """(token, float32 logprobs row) from mlx-lm's generate_step with the same processors."""
    out = []
    for t, lp in generate_step(mx.array(prompt), lm.model, max_tokens=params.max_tokens,
                               logits_processors=processors_for(params)):
        out.append((int(t), lp.astype(mx.float32)))
    return out


@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.3, "logit_bias": {17: 3.0}}])
def test_greedy_logprobs_equal_plain_mlx_lm(tiny_lm, extra):
    lm = tiny_lm("untied-mha")
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=N, logprobs=5, **extra)
    ref = reference(lm, prompt, params)
    for mode in ("mtp", "off"):
        got = tokens(lm, prompt, params, mode)
        assert [t.id for t in got] == [t for t, _ in ref][: len(got)]
        for t, (_, row) in zip(got, ref):
            lp = t.logprobs
            assert abs(lp.logprob - row[t.id].item()) < TOL
            assert len(lp.top) == 5
            ids = [i for i, _ in lp.top]
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            assert ids[0] == t.id and lp.logprob == max(values)  # greedy: the chosen token is the top one
            expected = mx.sort(row)[::-1][:5].tolist()
            assert max(abs(a - b) for a, b in zip(values, expected)) < TOL
            for i, v in lp.top:
                assert abs(v - row[i].item()) < TOL


def test_drafting_on_and_off_agree(tiny_lm):
    lm = tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=N, logprobs=3)
    spec, plain = tokens(lm, prompt, params, "mtp", depth=4), tokens(lm, prompt, params, "off")
    assert [t.id for t in spec] == [t.id for t in plain]
    for a, b in zip(spec, plain):
        assert abs(a.logprobs.logprob - b.logprobs.logprob) < TOL
        assert [i for i, _ in a.logprobs.top] == [i for i, _ in b.logprobs.top]


def test_sampled_logprobs_are_the_unwarped_distribution(tiny_lm):
    """Under temperature the values are still the model's (processed) distribution: they sum to
    at most 1 over the alternatives and the chosen token's value is in [-inf, 0]."""
    lm = tiny_lm("untied-mha")
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=N, temperature=0.8, seed=3, logprobs=0)
    for mode in ("mtp", "off"):
        got = tokens(lm, prompt, params, mode)
        assert len(got) == N and all(t.logprobs.top == () and t.logprobs.logprob <= 0 for t in got)


def test_off_by_default(tiny_lm):
    lm = tiny_lm("untied-mha")
    prompt = lm.tokenizer.encode(PROMPT)
    for mode in ("mtp", "off"):
        assert all(t.logprobs is None for t in tokens(lm, prompt, SamplingParams(max_tokens=8), mode))
    assert SamplingParams(logprobs=-1).logprobs is None
    for bad in (21, -2, True, 1.5):
        with pytest.raises(DynoError):
            SamplingParams(logprobs=bad)
