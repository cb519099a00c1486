"""The scale benchmark's pieces: the draft vocabulary floor, one context."""

import pytest

from speculative.loader import load_checkpoint
from speculative.measure import shapes
from speculative.measure.random_checkpoint import scaled_down, write_checkpoint
from speculative.measure.scale import draft_vocab_floor, measure_context, random_prompt


def test_draft_vocab_floor_is_autos():
    assert draft_vocab_floor(248320) == 31232


def test_one_context_is_exact_and_bounded(tmp_path):
    config = scaled_down(shapes.load("qwen3.5-0.8b")["text_config"])
    lm = load_checkpoint(write_checkpoint(tmp_path, config, seed=1), mode="mtp")
    record = measure_context(lm, random_prompt(32), [1, 2], (0.9, 0.7), max_tokens=24, pairs=1, reps=1)
    for k in (1, 2):
        d = record["depths"][k]
        assert d["identical"] and d["bound"] > 0 and d["efficiency"] > 0
        assert d["tokens_per_round"] == pytest.approx(1 + sum(d["acceptance_by_position"]))
    assert set(record["cost_model"]) >= {"T1", "Tv", "Td", "Td_draft_vocab"}
    cost_only = measure_context(lm, random_prompt(32), [1, 2], (0.9, 0.7), 24, 1, 1, paired=False, padded_to=300)
    assert cost_only["depths"][2]["tokens_per_round"] == pytest.approx(2.6) and "plain" not in cost_only
    assert cost_only["context"] == 300 and cost_only["padded"]


def test_padding_grows_every_attention_cache(tiny_lm):
    from mlx_lm.models.cache import KVCache

    import mlx.core as mx
    from speculative.measure.cost_model import pad_attention

    lm = tiny_lm("tied-gqa2")
    trunk, head = lm.target.make_cache(), lm.head.make_cache()
    tokens = mx.array([[1, 2, 3, 4]])
    lm.head(lm.target.embed(tokens), lm.target.hidden(tokens, trunk), head)
    pad_attention(trunk + head, 700)
    kv = [c for c in trunk + head if isinstance(c, KVCache)]
    assert len(kv) == 2 and all(c.offset == 700 for c in kv)
