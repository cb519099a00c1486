"""Log-probabilities of emitted tokens, read from the logits they were drawn from."""

from typing import List, Optional, Sequence

import mlx.core as mx

from ..events import TokenLogprobs


def scored(logprobs: Optional[mx.array], tokens: Sequence[int], top: Optional[int]) -> List[Optional[TokenLogprobs]]:
    """Each emitted token's log-probability and its `top` alternatives (None each when `top` is None,
    without touching MLX: no work and no host sync when logprobs are off).

    `logprobs` is [T, V] (or [V] for one token), T >= len(tokens): row i the log-softmax of the
    processed logits token i was drawn from (after the logits processors, before the warp). One
    host sync for all of them.
    """
    if top is None or not tokens:
        return [None] * len(tokens)
    rows = logprobs.reshape(-1, logprobs.shape[-1])[: len(tokens)].astype(mx.float32)
    chosen = mx.take_along_axis(rows, mx.array(list(tokens))[:, None], axis=-1)[:, 0]
    if top:
        ids = mx.argpartition(-rows, kth=top - 1, axis=-1)[:, :top]
        values = mx.take_along_axis(rows, ids, axis=-1)
        order = mx.argsort(-values, axis=-1)  # most likely first
        ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
        mx.eval(chosen, ids, values)
        pairs = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        mx.eval(chosen)
        pairs = [()] * len(tokens)
    return [TokenLogprobs(c, p) for c, p in zip(chosen.tolist(), pairs)]
