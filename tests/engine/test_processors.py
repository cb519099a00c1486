"""Logit bias and penalties keep drafting on and the output exact: equal to mlx-lm with the same processors."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.errors import DynoError
from speculative.events import Round, Token

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
SETTINGS = {
    "bias": dict(logit_bias={32: 4.0, 101: 3.0, 258: -100.0}),
    "repetition": dict(repetition_penalty=1.8, repetition_context_size=12),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.9, frequency_context_size=30),
    "all": dict(logit_bias={115: 2.5}, repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4),
}


def mlx_lm_reference(lm, prompt, n, **kw):
    """Plain mlx-lm greedy decoding with mlx-lm's own processors built from the same values."""
    processors = make_logits_processors(
        kw.get("logit_bias"), kw.get("repetition_penalty"), kw.get("repetition_context_size", 20),
        kw.get("presence_penalty"), kw.get("presence_context_size", 20),
        kw.get("frequency_penalty"), kw.get("frequency_context_size", 20))
    out = []
    for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n, logits_processors=processors):
        out.append(int(t))
        if out[-1] in lm.eos_token_ids:
            break
    return out


def run(lm, prompt, mode, depth=3, n=80, **kw):
    events = list(generate(lm, prompt, SamplingParams(max_tokens=n, **kw), SpecConfig(mode, depth)))
    return [e.id for e in events if isinstance(e, Token)], [e for e in events if isinstance(e, Round)]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ["tied-gqa2", "untied-mha"])
def test_speculative_greedy_with_processors_equals_mlx_lm(tiny_lm, name, setting):
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode(PROMPT)
    tokens, rounds = run(lm, prompt, "mtp", **SETTINGS[setting])
    assert tokens == mlx_lm_reference(lm, prompt, 80, **SETTINGS[setting])
    assert rounds and all(r.drafted == 3 for r in rounds)  # drafting stayed on


@pytest.mark.parametrize("setting", ["repetition", "all"])
def test_plain_path_applies_the_same_processors(tiny_lm, setting):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(PROMPT)
    tokens, rounds = run(lm, prompt, "off", n=60, **SETTINGS[setting])
    assert tokens == mlx_lm_reference(lm, prompt, 60, **SETTINGS[setting])
    assert rounds == []


def test_drafts_see_the_processors(tiny_lm):
    """A bias that decides every position makes the head agree with the trunk every time."""
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(PROMPT)
    tokens, rounds = run(lm, prompt, "mtp", depth=4, n=41, logit_bias={65: 100.0})
    assert tokens == [65] * 41
    assert len(rounds) == 8 and all(r.accepted == 4 for r in rounds)  # 1 + 8 x (4 drafts + bonus)


def test_penalties_see_drafts_before_their_row(tiny_lm):
    """A presence penalty on the last token makes 65 and 66 alternate; drafts must see earlier drafts."""
    lm = tiny_lm()
    prompt = lm.tokenizer.encode("x")
    kw = dict(logit_bias={65: 100.0, 66: 90.0}, presence_penalty=15.0, presence_context_size=1)
    tokens, rounds = run(lm, prompt, "mtp", depth=3, n=29, **kw)
    assert tokens == mlx_lm_reference(lm, prompt, 29, **kw) == [65, 66] * 14 + [65]
    assert len(rounds) == 7 and all(r.accepted == 3 for r in rounds)


@pytest.mark.parametrize("bad", [
    dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0), dict(presence_penalty=float("nan")),
    dict(logit_bias={-1: 1.0}), dict(logit_bias={3: float("inf")}), dict(frequency_context_size=0),
])
def test_invalid_processor_values_are_refused(bad):
    with pytest.raises(DynoError, match="invalid sampling value"):
        SamplingParams(**bad)


def test_logit_bias_is_stored_hashable():
    a = SamplingParams(logit_bias={5: 1.0, 2: -1.0})
    assert a.logit_bias == ((2, -1.0), (5, 1.0)) and hash(a) == hash(SamplingParams(logit_bias={2: -1.0, 5: 1.0}))
    assert not SamplingParams().has_processors and a.has_processors
