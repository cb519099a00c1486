"""A draft vocabulary: the draft step scores a subset of the vocabulary; output stays exact."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from helpers.reference import plain_greedy
from speculative.config import SamplingParams, SpecConfig
from speculative.draft_vocab import DraftLMHead, draft_lm_head, ranked_ids, special_ids
from speculative.engine import generate
from speculative.errors import DynoError
from speculative.events import Token


def tokens_of(lm, prompt, spec, n=60):
    return [e.id for e in generate(lm, prompt, SamplingParams(max_tokens=n), spec) if isinstance(e, Token)]


def test_ranked_ids_keep_every_special_token_and_the_lowest_ids(tiny_lm):
    lm = tiny_lm()
    vocab = lm.target.args.vocab_size
    specials = special_ids(lm.tokenizer, vocab)
    assert specials and set(lm.eos_token_ids) <= set(specials)
    ids = ranked_ids(lm.tokenizer, vocab, 40)
    assert ids == sorted(set(specials) | set(range(40 - len(specials))))
    assert len(ids) == 40


@pytest.mark.parametrize("quantized", [False, True])
def test_subset_logits_equal_the_full_rows_and_minus_infinity_elsewhere(quantized):
    mx.random.seed(0)
    layer = nn.Linear(64, 96, bias=False)
    if quantized:
        layer = nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4)
    ids = [0, 3, 5, 50, 95]
    head = DraftLMHead(layer, ids, 96)
    h = mx.random.normal((2, 64))
    full, got = np.array(layer(h)), np.array(head(h))
    assert np.array_equal(got[:, ids], full[:, ids])
    off = np.setdiff1d(np.arange(96), ids)
    assert np.all(np.isneginf(got[:, off]))


@pytest.mark.parametrize("name", ["tied-gqa2", "untied-mha", "moe-fused"])
@pytest.mark.parametrize("size", [8, 100])
def test_greedy_output_is_plain_greedy_with_a_draft_vocabulary(tiny_lm, name, size):
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode("def f(x):")
    assert tokens_of(lm, prompt, SpecConfig("mtp", 3, draft_vocab=size)) == plain_greedy(lm, prompt, 60)


def test_the_bundled_head_still_drafts_well_from_half_its_vocabulary():
    from dyno_ui.paths import BUNDLED_MODEL
    from speculative.loader import load_model
    from speculative.stats import GenerationStats

    lm = load_model(BUNDLED_MODEL)
    prompt = lm.tokenizer.encode('def read_config(path):\n    """Read the config file at path."""\n')
    accepted = {}
    for size in (None, 2048):
        stats = GenerationStats()
        for e in generate(lm, prompt, SamplingParams(max_tokens=80), SpecConfig("mtp", 2, draft_vocab=size)):
            stats.add(e)
        accepted[size] = stats.accepted_tokens
        assert stats.tokens == plain_greedy(lm, prompt, 80)
    assert accepted[2048] > 0.5 * accepted[None]


def test_the_draft_projection_is_built_once_per_model_and_size(tiny_lm):
    lm = tiny_lm()
    assert draft_lm_head(lm, 50) is draft_lm_head(lm, 50)
    assert draft_lm_head(lm, None) == lm.target.lm_head and draft_lm_head(lm, 10**6) == lm.target.lm_head


@pytest.mark.parametrize("bad", [0, -3, 2.5, "many"])
def test_a_bad_draft_vocabulary_is_refused(bad):
    with pytest.raises(DynoError, match="draft vocabulary must be a number of tokens >= 1 or full"):
        SpecConfig("mtp", 2, draft_vocab=bad)
