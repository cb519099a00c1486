"""Checkpoint formats: bf16, and an MLX-quantized conversion (head dropped) with a head folder."""

import pytest

import mlx.core as mx
from helpers import tiny_models
from helpers.reference import plain_greedy
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token
from speculative.loader import load_checkpoint
from speculative.heads.mtp import read_checkpoint_head, write_head_folder

PROMPT = "for i in range(10):\n    print(i)\n"


def tokens(lm, prompt, depth, n=120):
    events = generate(lm, prompt, SamplingParams(max_tokens=n), SpecConfig("mtp", depth))
    return [e.id for e in events if isinstance(e, Token)]


def test_bf16_checkpoint(tmp_path):
    lm = load_checkpoint(tiny_models.build(tmp_path / "bf16", seed=1, dtype=mx.bfloat16))
    assert lm.head is not None and lm.head.fc.weight.dtype == mx.bfloat16
    prompt = lm.tokenizer.encode(PROMPT)
    assert tokens(lm, prompt, 3) == plain_greedy(lm, prompt, 120)


def test_quantized_conversion_with_head_folder(tiny_dir, tmp_path):
    from mlx_lm import convert

    source = tiny_dir()
    converted = tmp_path / "q4"
    convert(hf_path=str(source), mlx_path=str(converted), quantize=True, q_group_size=32, q_bits=4)
    bare = load_checkpoint(converted)
    assert bare.head is None  # mlx_lm.convert drops the head, as community conversions do
    with pytest.raises(Exception) as e:
        load_checkpoint(converted, mode="mtp")
    assert "has no mtp.* tensors" in str(e.value)
    head = write_head_folder(tmp_path / "head", read_checkpoint_head(source), tiny_models.text_config())
    lm = load_checkpoint(converted, mode="mtp", mtp_head=str(head))
    prompt = lm.tokenizer.encode(PROMPT)
    for depth in (1, 3):
        assert tokens(lm, prompt, depth) == plain_greedy(lm, prompt, 120)
