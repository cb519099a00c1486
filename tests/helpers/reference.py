"""The reference every exactness test holds Dyno against: mlx-lm's own plain decoding."""

import mlx.core as mx
from mlx_lm.generate import generate_step


def plain_greedy(lm, prompt, n, prefill_step=2048, stop_at_eos=True):
    """mlx-lm's own greedy decoding (cut after EOS): the reference speculative runs must equal."""
    out = []
    for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n, prefill_step_size=prefill_step):
        out.append(int(t))
        if stop_at_eos and out[-1] in lm.eos_token_ids:
            break
    return out
