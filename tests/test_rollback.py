"""After any round, every cache equals what a fresh sequential run over the committed tokens gives."""

import random

import mlx.core as mx
import numpy as np
import pytest

import speculative.target as target_mod
from conftest import plain_greedy
from speculative.config import SamplingParams
from speculative.engine import Speculator


class CoinFlipSpeculator(Speculator):
    """Drafts the reference token or a wrong one at random, so acceptance takes every value."""

    def __init__(self, *args, reference, rng, **kw):
        super().__init__(*args, **kw)
        self.reference, self.rng = reference, rng

    def _draft(self, k):
        start = len(self.generated)
        out = []
        for t in self.reference[start : start + k]:
            out.append(t if self.rng.random() < 0.75 else (t + 1) % self.target.args.vocab_size)
        return mx.array(out), None


def fresh_caches(lm, tokens):
    """Trunk and head caches from a plain sequential run: prompt chunk, then one token at a time."""
    target, head = lm.target, lm.head
    trunk, head_cache = target.make_cache(), head.make_cache()
    consumed = tokens[:-1]  # the last token is pending: sampled but not yet fed
    hiddens = [target.hidden(mx.array(consumed[:4])[None], trunk)]
    for t in consumed[4:]:
        hiddens.append(target.hidden(mx.array([[t]]), trunk))
    hidden = mx.concatenate(hiddens, axis=1)
    head(target.embed(mx.array(tokens[1:])[None]), hidden, head_cache)  # row p: (t_{p+1}, h_p)
    return trunk, head_cache


def assert_close(a, b, what):
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4, err_msg=what)


def assert_caches_equal(spec, trunk, head_cache):
    for i, (got, want) in enumerate(zip(spec.trunk_cache, trunk)):
        if hasattr(want, "offset"):  # attention KV
            assert got.offset == want.offset, f"layer {i} offset"
            n = want.offset
            assert_close(got.keys[..., :n, :], want.keys[..., :n, :], f"layer {i} keys")
            assert_close(got.values[..., :n, :], want.values[..., :n, :], f"layer {i} values")
        else:  # Gated DeltaNet: conv window and recurrent state
            assert_close(got[0], want[0], f"layer {i} conv state")
            assert_close(got[1], want[1], f"layer {i} recurrent state")
    (got,), (want,) = spec.head_cache, head_cache
    assert got.offset == want.offset, "head offset"
    assert_close(got.keys[..., : want.offset, :], want.keys[..., : want.offset, :], "head keys")
    assert_close(got.values[..., : want.offset, :], want.values[..., : want.offset, :], "head values")


@pytest.mark.parametrize("name, path", [("gqa4-gdn1to1", "per-step-states"), ("gqa4-gdn1to1", "replay"),
                                        ("moe-fused", "per-step-states")])
def test_rollback_matches_fresh_run(tiny_lm, monkeypatch, name, path):
    if path == "replay":  # the branch Metal takes: only the final state, replay on commit
        monkeypatch.setattr(target_mod, "_kernel_path", lambda layer: True)
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode("import os\nimport sys\n\n")
    reference = plain_greedy(lm, prompt, 80, stop_at_eos=False)
    spec = CoinFlipSpeculator(lm, SamplingParams(max_tokens=80), 3, 2048, reference=reference,
                              rng=random.Random(0))
    steps = spec.run(prompt)
    next(steps)  # the prefill token
    seen = set()
    while len(spec.generated) < 60:
        accepted, _ = spec._round()
        seen.add(len(accepted))
        assert spec.generated == reference[: len(spec.generated)]
        assert_caches_equal(spec, *fresh_caches(lm, prompt + spec.generated))
    assert seen == {0, 1, 2, 3}  # every rollback length was exercised
