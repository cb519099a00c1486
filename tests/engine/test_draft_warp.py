"""The drafts' warp: q skips top-p's sort when top-k already bounds the support (any q is exact;
the chi-square tests in test_distribution.py run with top-p and top-k together)."""

import mlx.core as mx
import numpy as np

from speculative.config import SamplingParams
from speculative.round.row import Row
from speculative.round.sampling import draft_params, warp


def test_top_p_is_dropped_only_under_top_k():
    both = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, seed=1)
    assert draft_params(both, 4096) == SamplingParams(temperature=0.6, top_p=1.0, top_k=20, min_p=0.05, seed=1)
    only_p = SamplingParams(temperature=0.6, top_p=0.95)
    assert draft_params(only_p, 4096) is only_p  # nothing else bounds the support: q keeps top-p
    wide_k = SamplingParams(temperature=0.6, top_p=0.95, top_k=4096)
    assert draft_params(wide_k, 4096) is wide_k  # a top-k at the vocabulary size filters nothing


def test_drafts_are_drawn_from_the_top_k_warp(tiny_lm):
    lm = tiny_lm()
    params = SamplingParams(temperature=1.0, top_p=0.5, top_k=3)  # unseeded: seeded drafts take p's own warp
    spec = Row(params, lm.eos_token_ids, lm.vocab_size)
    row = mx.full((1, lm.vocab_size), -30.0).at[0, :4].add(mx.array([33.0, 32.0, 31.0, 30.5]))
    token, q = spec.pick(row)
    q = np.array(q[0])
    # top-p 0.5 alone would keep token 0 only; q keeps the top-k three, as the tempered softmax
    assert np.count_nonzero(q) == 3 and int(token.item()) in (0, 1, 2)
    np.testing.assert_allclose(q, np.array(mx.exp(warp(row, SamplingParams(temperature=1.0, top_k=3)))[0]))
    assert np.count_nonzero(np.array(mx.exp(warp(row, params)))) == 1  # p itself keeps top-p
