"""Warp logits into the distribution we sample from, and draw from it.

The warp reproduces mlx-lm's `make_sampler` exactly: filters (top-p, min-p, top-k, in that
order) act on the untempered log-probabilities, then the survivors are scaled by 1/temperature.
The same warp is applied to draft rows and target rows, which the lossless rule requires.
"""

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .config import SamplingParams


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities along the last axis, computed as mlx-lm's generate_step does."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def warp(logits: mx.array, params: SamplingParams) -> mx.array:
    """Normalised log-probabilities of the sampling distribution ([..., V]); -inf off-support."""
    logprobs = log_softmax(logits.astype(mx.float32))
    vocab = logprobs.shape[-1]
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < vocab:
        logprobs = apply_top_k(logprobs, params.top_k)
    return log_softmax(logprobs * (1.0 / params.temperature))


def draw(logprobs: mx.array, key: mx.array) -> mx.array:
    """One token per row from normalised log-probabilities."""
    return mx.random.categorical(logprobs, axis=-1, key=key)
