"""Seeded sampling as plain mlx-lm draws it: a seed's keys by position, and the draw that uses them."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token
from speculative.sampling import KeyChain, effective_top_k, seeded_pick

WARPS = [dict(temperature=0.3), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=20),
         dict(temperature=0.7, min_p=0.1), dict(temperature=1.0, top_p=0.8, top_k=50, min_p=0.02)]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("warp", WARPS, ids=str)
def test_a_positions_key_draws_what_mlx_lm_draws_at_that_step(warp, dtype):
    rows = (mx.random.normal((12, 1, 500), key=mx.random.key(3)) * 3).astype(dtype)
    params = SamplingParams(**warp, seed=42)
    sampler = make_sampler(params.temperature, params.top_p, params.min_p, top_k=effective_top_k(params, 500))
    mx.random.seed(42)
    plain = [sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)).item() for row in rows]
    keys = KeyChain(42)
    # Out of order, as rounds that draft, reject and draw again reach positions.
    order = [3, 0, 1, 2, 5, 4, 11, 6, 7, 9, 8, 10]
    picked = {i: seeded_pick(rows[i], params, keys[i]).item() for i in order}
    assert [picked[i] for i in range(12)] == plain
    assert len(set(plain)) > 3  # the rows really were sampled, not all argmax


def test_a_seeded_plain_generation_is_mlx_lms_own(tiny_lm):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode("def merge(a, b):\n")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=40)
    got = [e.id for e in generate(lm, prompt, params, SpecConfig(mode="off")) if isinstance(e, Token)]
    mx.random.seed(7)
    sampler = make_sampler(0.8, 0.95)
    want = [int(t) for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=40, sampler=sampler)]
    want = want[: next((i + 1 for i, t in enumerate(want) if t in lm.eos_token_ids), len(want))]
    assert got == want
