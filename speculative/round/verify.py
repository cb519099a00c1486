"""Acceptance rules as pure functions of arrays (no model, no cache).

Names: `draft_probs` (q) is the distribution each draft token was drawn from; `target_probs`
(p) is the trunk's warped distribution at the same position. Row i of the target scores draft
i + 1; row k (one past the last draft) gives the bonus token when every draft is kept.
"""

import math
from typing import Tuple

import mlx.core as mx


def _accepted_prefix(keep: mx.array) -> mx.array:
    """Length of the leading run of True along the last axis of `keep` ([..., k] bool), int32."""
    return mx.cumprod(keep.astype(mx.int32), axis=-1).sum(axis=-1)


def greedy_accept(draft_tokens: mx.array, target_logprobs: mx.array) -> Tuple[mx.array, mx.array]:
    """Keep drafts while they equal the trunk's argmax; return (n_accepted, next_token).

    next_token is the argmax at the first mismatch (correction) or at row k (bonus). Rows of a
    batch ([B, k] drafts, [B, k+1, V] log-probabilities) are accepted each on its own.
    """
    return agreeing_accept(draft_tokens, mx.argmax(target_logprobs, axis=-1))


def agreeing_accept(draft_tokens: mx.array, target_tokens: mx.array) -> Tuple[mx.array, mx.array]:
    """Keep drafts while they equal the trunk's own tokens at their positions ([..., k + 1]: its argmax,
    or its draw with the position's key for a seeded request); return (n_accepted, next_token).

    Exact for any drafts: every token emitted is the trunk's, each following the ones kept before it.
    """
    k = draft_tokens.shape[-1]
    n = _accepted_prefix(draft_tokens == target_tokens[..., :k])
    return n, mx.take_along_axis(target_tokens, n[..., None], axis=-1)[..., 0]


CONFIDENT = 0.5  # the target's probability of its own top token that makes a position count (heads/health.py)


def confident_rows(target: mx.array, k: int, logprobs: bool, threshold: float = CONFIDENT) -> mx.array:
    """[..., k] bool: the target's top token has probability >= `threshold` at rows 0..k-1 (the drafts'
    positions); `target` holds log-probabilities when `logprobs`, else probabilities."""
    top = mx.max(target[..., :k, :], axis=-1)
    return top >= (math.log(threshold) if logprobs else threshold)


def residual(target_probs: mx.array, draft_probs: mx.array) -> mx.array:
    """normalize(max(p - q, 0)) row-wise: what to draw from after a rejection."""
    r = mx.maximum(target_probs - draft_probs, 0.0)
    total = r.sum(axis=-1, keepdims=True)
    # total == 0 only when p == q, where rejection has probability 0; avoid 0/0 regardless.
    return r / mx.where(total > 0, total, 1.0)


# Compiled: one fused graph instead of some twenty small kernels. With an explicit key it is a
# pure function, so compiling it cannot change what it draws; it retraces once per depth.
@mx.compile
def lossless_accept(
    draft_tokens: mx.array,  # [k] int
    draft_probs: mx.array,  # [k, V] q rows
    target_probs: mx.array,  # [k + 1, V] p rows
    key: mx.array,
) -> Tuple[mx.array, mx.array]:
    """Standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw
    from normalize(max(p_i - q_i, 0)); if all k are kept draw the bonus from p_k. The emitted
    sequence is distributed exactly as sampling from p alone. Returns (n_accepted, next_token).
    """
    k = draft_tokens.shape[0]
    accept_key, draw_key = mx.random.split(key)
    idx = draft_tokens[:, None]
    p_d = mx.take_along_axis(target_probs[:k], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(draft_probs, idx, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,), key=accept_key)
    n = _accepted_prefix(u * q_d < p_d)  # u < p/q without dividing by q
    rows = mx.concatenate([residual(target_probs[:k], draft_probs), target_probs[k:]], axis=0)
    chosen = rows[n]
    next_token = mx.random.categorical(mx.log(chosen), key=draw_key)
    return n, next_token
