"""Warp logits into the distribution we sample from, and draw from it.

The warp reproduces mlx-lm's sampling numerics exactly, so `--speculative mtp` draws from the
very distribution plain decoding draws from: generate_step's log-softmax and make_sampler's
filters (top-p, min-p, top-k, in that order) and 1/temperature scaling all run in the logits'
own dtype (bf16 for most checkpoints); only the final normalisation, which the acceptance
arithmetic reads, is float32. Draft rows are warped the same way, but for top-p when top-k is set
(`draft_params`): the lossless rule needs only the q the drafts were drawn from.
"""

import dataclasses

import mlx.core as mx
from mlx_lm.sample_utils import Sampler, apply_min_p, apply_top_k, apply_top_p, make_sampler

from ..config import SamplingParams


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities along the last axis, in the logits' dtype, as mlx-lm's generate_step."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def filtered(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """make_sampler's filters on untempered log-probabilities, in their dtype; -inf when cut."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    top_k = effective_top_k(params, logprobs.shape[-1])
    if top_k:
        logprobs = apply_top_k(logprobs, top_k)
    return logprobs


def scores(logits: mx.array, params: SamplingParams) -> mx.array:
    """What mlx-lm's sampler hands mx.random.categorical for processed logits: the tempered, filtered
    log-softmax, in the logits' dtype (generate_step's log-softmax, then make_sampler's)."""
    return tempered(filtered(log_softmax(logits), params), params)


def tempered(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """What categorical_sampling hands mx.random.categorical: logprobs * (1/temp) in their dtype."""
    # The factor is a Python float, so MLX rounds it to the array's dtype and the product stays
    # there (bf16 rows are scaled by bf16(1/temp)), exactly as in mlx-lm.
    return logprobs * (1.0 / params.temperature)


def warp(logits: mx.array, params: SamplingParams) -> mx.array:
    """Float32 log-probabilities of plain decoding's sampling distribution; -inf off-support."""
    # In the dtype the processors left, as plain decoding (mlx-lm's logit bias makes rows float32).
    # mx.random.categorical(scores) adds float32 Gumbel noise (bf16 widens exactly) and takes the
    # argmax: plain decoding realises softmax(float32(scores)). Casting any earlier would round,
    # tie and cut differently; float32 from here on is what the p/q ratios and residual need.
    return log_softmax(scores(logits, params).astype(mx.float32))


def draft_params(params: SamplingParams, vocab: int) -> SamplingParams:
    """The warp the drafts are drawn with. The lossless rule is exact for any q it is told
    (mtp-reference.md), so q need not be p's warp: with top-k bounding the support, top-p's sort
    of the whole vocabulary changes q only in the last few tokens, and drafts skip it (position-1
    acceptance on the bundled model, teacher-forced over the four suites: 0.6755 either way at
    T=0.6, 0.6513 against 0.6505 at T=1.0; tools/draft_warp.py)."""
    if effective_top_k(params, vocab) and params.top_p < 1.0:
        return dataclasses.replace(params, top_p=1.0)
    return params


def draw(logprobs: mx.array, key: mx.array) -> mx.array:
    """One token per row from normalised log-probabilities."""
    return mx.random.categorical(logprobs, axis=-1, key=key)


class KeyChain:
    """A seed's random keys by token position, as plain mlx-lm draws them: after mx.random.seed(s) every
    sampling call splits the global key and draws with the second half, so token i of a generation is
    drawn with the i-th such half, whatever was drafted or rolled back around it."""

    def __init__(self, seed: int):
        self._state, self._keys = mx.random.key(seed), []

    def __getitem__(self, position: int) -> mx.array:
        while len(self._keys) <= position:
            self._state, sub = mx.random.split(self._state)
            self._keys.append(sub)
        return self._keys[position]


def seeded_pick(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """Plain mlx-lm's token for one [1, V] processed logits row drawn with `key`: categorical over `scores`.

    Gumbel-max, so the draft drawn with a position's key on the head's logits and the target's token
    drawn with it on the trunk's agree or not as the two rows do (issue: seeded requests)."""
    # One call per row, in mlx-lm's [1, V] shape: categorical's noise depends on the shape it is drawn
    # for (a [V] row or a [k, V] block draws other tokens with the same key).
    return mx.random.categorical(scores(logits, params), key=key)


def effective_top_k(params: SamplingParams, vocab: int) -> int:
    """top_k as every path applies it: at or above the vocabulary size it filters nothing (0)."""
    return params.top_k if params.top_k < vocab else 0


def plain_sampler(params: SamplingParams, vocab: int) -> Sampler:
    """mlx-lm's sampler for the paths that do not draft (plain, batched, bench)."""
    return make_sampler(params.temperature, params.top_p, params.min_p,
                        top_k=effective_top_k(params, vocab))
