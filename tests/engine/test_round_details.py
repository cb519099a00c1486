"""Round events carry what was drafted (always) and why each draft was kept (SpecConfig.details):
the drafted ids are the ones the verify pass checked, the details read the rows the round already
computed (greedy p equals the emitted tokens' logprobs), and asking for them changes no token."""

import math

import pytest

from dyno_ui.paths import BUNDLED_MODEL
from helpers.drafts import rounds_with_tokens
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from helpers.drafts import recording_drafter
from speculative.errors import DynoError
from speculative.events import Provenance, Round, Token
from speculative.loader import load_checkpoint

PROMPT = 'def read_lines(path):\n    """Return the lines of the file at path."""\n'
N = 48
TOL = 1e-5  # exp of the same float32 log-probability row, gathered two ways


@pytest.fixture(scope="module")
def lm():
    return load_checkpoint(BUNDLED_MODEL)  # its trained head drafts tokens the trunk accepts and refuses


def events(lm, params, details, depth=3, drafter=None):
    prompt = lm.tokenizer.encode(PROMPT)
    return list(generate(lm, prompt, params, SpecConfig("mtp", depth, details=details), drafter=drafter))


def tokens(evs):
    return [e.id for e in evs if isinstance(e, Token)]


def test_greedy_output_with_details_equals_without(lm):
    params = SamplingParams(max_tokens=N)
    on, off = events(lm, params, True), events(lm, params, False)
    assert tokens(on) == tokens(off)
    assert all(r.details is None for r in off if isinstance(r, Round))
    assert all(r.details is not None for r in on if isinstance(r, Round))


def test_sampled_output_with_details_equals_without_at_one_seed(lm):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=N, seed=7)
    on = events(lm, params, True)
    assert tokens(on) == tokens(events(lm, params, False))
    for r, _ in rounds_with_tokens(on):
        d = r.details
        assert len(d.p) == len(d.q) == len(d.accept) == r.drafted
        for p, q, a in zip(d.p, d.q, d.accept):
            assert 0 <= p <= 1 and 0 < q <= 1
            assert a == pytest.approx(min(1.0, p / q), rel=1e-5)
        assert 0 < d.next_p <= 1


def test_round_drafts_are_the_verified_drafts(lm):
    verified = []  # the drafts the drafter handed each round's verify pass
    params = SamplingParams(max_tokens=N)
    evs = events(lm, params, False, drafter=recording_drafter(verified))
    verified = [d.tolist() for d in verified]
    pairs = rounds_with_tokens(evs)
    assert [list(r.drafts) for r, _ in pairs] == verified[: len(pairs)]
    rejected = 0
    for r, toks in pairs:
        assert len(r.drafts) == r.drafted == 3
        kept = [t.id for t in toks if t.provenance is Provenance.DRAFT]
        assert kept == list(r.drafts[: len(kept)])
        last = toks[-1] if len(toks) == r.accepted + 1 else None
        if last is not None and last.provenance is Provenance.CORRECTION:
            assert last.id != r.drafts[r.accepted]  # greedy: the correction replaced a refused draft
            rejected += 1
    assert rejected > 0 and any(r.accepted for r, _ in pairs)  # both outcomes were exercised


def test_greedy_details_match_the_engines_logprobs(lm):
    params = SamplingParams(max_tokens=N, logprobs=0)
    for r, toks in rounds_with_tokens(events(lm, params, True)):
        d = r.details
        assert d.q == (None,) * r.drafted
        for i, t in enumerate(toks):
            if t.provenance is Provenance.DRAFT:
                assert d.p[i] == pytest.approx(math.exp(t.logprobs.logprob), abs=TOL)
                assert d.accept[i] == 1.0  # kept: it was the argmax
            else:
                assert d.next_p == pytest.approx(math.exp(t.logprobs.logprob), abs=TOL)
        if len(toks) == r.accepted + 1 and toks[-1].provenance is Provenance.CORRECTION:
            assert d.accept[r.accepted] == 0.0  # the refused draft was not the argmax


def test_details_must_be_a_bool():
    with pytest.raises(DynoError, match="details must be true or false"):
        SpecConfig("mtp", 3, details="yes")
