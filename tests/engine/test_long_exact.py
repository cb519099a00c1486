"""Exact at long context: a multi-turn session whose turns resume from the prompt cache gives plain
mlx-lm's cold tokens (generate_step on the whole conversation) at 4k, 8k and 16k tokens; and where
a resumed turn's prefill chunks fall differently from a cold run's, no bit of the prompt's rows
changes (speculative/measure/exact.py; the stand-in with OpenBLAS: tools/long_exact.py)."""

import random

import mlx.core as mx
import pytest

from helpers.reference import plain_greedy
from speculative.loader import load_checkpoint
from speculative.measure.blas import detect
from speculative.measure.exact import chunk_bits, long_exact_session
from speculative.prompt_cache.store import PrefixCache

reference_blas = pytest.mark.skipif(
    not detect().reference,
    reason="OpenBLAS computes a float32 product's rows alone differently from in company: chunks change "
           "bits there (docs/how-it-works.md, Exactness at long context)")


@reference_blas
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_prefill_chunk_boundaries_change_no_bit_of_the_prompt(tiny_dir, dtype):
    """A prompt chunked as mlx-lm's cold run chunks it and as a turn resumed at an odd position
    chunks it (ending at its message boundaries, odd lengths among them): the last row's logits and
    every cache come out the same bit for bit."""
    lm = load_checkpoint(tiny_dir(dtype=dtype))
    prompt = random.Random(3).choices(range(256), k=1200)
    bits = chunk_bits(lm, prompt, 301, cuts=[600, 1001], step=256)
    assert bits["cold_ends"] == [256, 512, 768, 1024, 1199]
    assert bits["resumed_ends"] == [256, 301, 557, 600, 856, 1001, 1199]  # (a step from the last cut)
    assert bits["logits"] == 0.0 and bits["caches"] == 0.0


def check_session(lm, contexts):
    turns = list(long_exact_session(lm, PrefixCache(), contexts, answer_tokens=16, reference=plain_greedy))
    assert [t["identical"] for t in turns] == [True] * len(contexts), turns
    assert turns[0]["restored"] == 0
    for before, turn in zip(turns, turns[1:]):
        # The earlier turn's prompt and answer but its last token (never fed to the trunk): restored,
        # at a position that is no multiple of 2048, so the resumed chunks fall unlike a cold run's.
        assert turn["restored"] == before["context"] - 1 and turn["restored"] % 2048
    assert [t["context"] for t in turns] == list(contexts)


# A test model of one recurrent and one attention layer of one head, with room for 32k positions:
# both kinds of cache, at a fifth of the default test model's time (a Dyno prefill computes the last
# layer's attention for every prompt row, since the head reads its output; MLX's CPU attention is slow).
LONG = dict(num_hidden_layers=2, full_attention_interval=2, num_attention_heads=1, num_key_value_heads=1,
            max_position_embeddings=32768)


def test_a_session_resumed_from_the_prompt_cache_equals_mlx_lm_cold_at_4k(tiny_dir):
    check_session(load_checkpoint(tiny_dir(**LONG)), [1500, 4096])


@pytest.mark.slow
def test_dyno_tiny_resumed_at_4k_equals_mlx_lm_cold():
    """The bundled model (bfloat16; 4096 positions, so 4k is as far as it goes)."""
    check_session(load_checkpoint("assets/dyno-tiny"), [1500, 4096])


@pytest.mark.slow
def test_a_session_resumed_at_8k_and_16k_equals_mlx_lm_cold(tiny_dir):
    """Turns at 4k, 8k and 16k tokens, each resumed."""
    check_session(load_checkpoint(tiny_dir(**LONG)), [4096, 8192, 16384])
