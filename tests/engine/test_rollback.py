"""After any round, every cache is bit for bit what a fresh sequential run over the committed tokens gives."""

import random

import mlx.core as mx
import pytest

import speculative.target as target_mod
from helpers.reference import plain_greedy
from speculative.batched import BatchSpeculator
from speculative.config import SamplingParams
from speculative.events import Round
from speculative.round.drafter import Drafts


class CoinFlipDrafter:
    """Drafts the reference token or a wrong one at random, so acceptance takes every value."""

    def __init__(self, reference, rng, vocab):
        self.reference, self.rng, self.vocab = reference, rng, vocab

    def propose(self, rounds, budgets):
        (row,), (k,) = rounds.rows, budgets
        start = len(row.generated)
        out = [t if self.rng.random() < 0.75 else (t + 1) % self.vocab for t in self.reference[start : start + k]]
        return Drafts(mx.array([out]), [None], [k])


class FreshRun:
    """The reference: plain sequential decoding of the committed tokens, as mlx-lm decodes (the
    prompt but its last token in one chunk, then one token at a time), with the head's row p on
    (t_{p+1}, h_p). It only ever moves forward, so nothing in it is rolled back."""

    def __init__(self, lm, prompt):
        self.target, self.head = lm.target, lm.head
        self.trunk, self.head_cache = self.target.make_cache(), self.head.make_cache()
        self.fed = list(prompt[:-1])
        self.hiddens = [self.target.hidden(mx.array(self.fed)[None], self.trunk)]
        self.head_rows = 0  # positions whose head row is in head_cache

    def caches(self, tokens):
        """Trunk and head caches over `tokens` (the last one pending: sampled, not yet fed)."""
        for t in tokens[len(self.fed) : -1]:
            self.hiddens.append(self.target.hidden(mx.array([[t]]), self.trunk))
            self.fed.append(t)
        hidden = mx.concatenate(self.hiddens, axis=1)
        n = len(self.fed)
        new = mx.array(tokens[self.head_rows + 1 : n + 1])[None]  # row p: (t_{p+1}, h_p)
        self.head(self.target.embed(new), hidden[:, self.head_rows : n], self.head_cache)
        self.head_rows = n
        return self.trunk, self.head_cache


def assert_same(got, want, what):
    """Bit for bit: same dtype, same shape, every element equal."""
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    assert mx.array_equal(got, want).item(), f"{what}: differs by up to {mx.abs(got - want).max().item():.3g}"


def offset(cache) -> int:
    """A cache's position (a one-row batch cache's offset is a [1] array)."""
    return int(mx.array(cache.offset).reshape(-1)[0])


def assert_caches_equal(spec, trunk, head_cache):
    """A one-row batch's caches (at width 1 rollback trims: no left padding) against `trunk`'s and `head_cache`'s."""
    assert len(spec.trunk_cache) == len(trunk)
    for i, (got, want) in enumerate(zip(spec.trunk_cache, trunk)):
        if hasattr(want, "offset"):  # attention KV: rows past the offset are free space
            assert offset(got) == want.offset, f"layer {i} offset"
            n = want.offset
            assert_same(got.keys[..., :n, :], want.keys[..., :n, :], f"layer {i} keys")
            assert_same(got.values[..., :n, :], want.values[..., :n, :], f"layer {i} values")
        else:  # Gated DeltaNet: conv window and recurrent state
            assert_same(got[0], want[0], f"layer {i} conv state")
            assert_same(got[1], want[1], f"layer {i} recurrent state")
    (got,), (want,) = spec.head_cache, head_cache
    assert offset(got) == want.offset, "head offset"
    assert_same(got.keys[..., : want.offset, :], want.keys[..., : want.offset, :], "head keys")
    assert_same(got.values[..., : want.offset, :], want.values[..., : want.offset, :], "head values")


@pytest.mark.parametrize("name, path", [("gqa4-gdn1to1", "per-step-states"), ("gqa4-gdn1to1", "replay"),
                                        ("moe-fused", "per-step-states")])
def test_rollback_matches_fresh_run(tiny_lm, monkeypatch, name, path):
    if path == "replay":  # the branch Metal takes: only the final state, replay on commit
        monkeypatch.setattr(target_mod, "kernel_path", lambda layer: True)
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode("import os\nimport sys\n\n")
    reference = plain_greedy(lm, prompt, 80, stop_at_eos=False)
    spec = BatchSpeculator(lm, drafter=CoinFlipDrafter(reference, random.Random(0), lm.vocab_size))
    spec.join("r", prompt, SamplingParams(max_tokens=80))  # the prefill token
    (row,) = spec.rows
    fresh = FreshRun(lm, prompt)
    seen = set()
    while len(row.generated) < 60:
        (r,) = [e for e in spec.step(3)["r"].events if isinstance(e, Round)]
        seen.add(r.accepted)
        assert row.generated == reference[: len(row.generated)]
        assert_caches_equal(spec, *fresh.caches(prompt + row.generated))
    assert seen == {0, 1, 2, 3}  # every rollback length was exercised
