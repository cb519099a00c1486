"""A draft vocabulary: the draft step scores a subset of the vocabulary; output stays exact."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from helpers.reference import plain_greedy
from speculative.draft_vocab import rank as vocab_rank
from speculative.config import SamplingParams, SpecConfig
from speculative.draft_vocab.head import (AUTO, AUTO_MIN_VOCAB, DraftLMHead, auto_size, draft_lm_head, greedy_token,
                                     ranked_ids, resolve, special_ids)
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


@pytest.mark.parametrize("quantized", [False, True])
def test_the_greedy_draft_is_the_argmax_of_the_full_row(quantized):
    mx.random.seed(1)
    layer = nn.Linear(64, 96, bias=False)
    layer.weight = mx.concatenate([layer.weight[:48], layer.weight[:48]])  # rows i and i + 48 tie
    if quantized:
        layer = nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4)
    ids = [0, 3, 5, 50, 51, 53, 95]  # 3 and 51, 5 and 53 tie: the lowest id wins in both
    head = DraftLMHead(layer, ids, 96)
    h = mx.random.normal((5, 64))
    want = np.array(mx.argmax(head(h), axis=-1))
    got = head.greedy(h)
    assert got.dtype == mx.argmax(head(h), axis=-1).dtype and np.array_equal(np.array(got), want)
    assert np.array_equal(np.array(greedy_token(head, h)), want)
    assert np.array_equal(np.array(greedy_token(layer, h)), np.array(mx.argmax(layer(h), axis=-1)))
    assert set(want) - set(ids) == set() and len(set(want)) > 1  # the cases are not all one token


@pytest.mark.parametrize("name", ["tied-gqa2", "untied-mha", "moe-fused"])
@pytest.mark.parametrize("size", [8, 100])
def test_greedy_output_is_plain_greedy_with_a_draft_vocabulary(tiny_lm, name, size):
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode("def f(x):")
    assert tokens_of(lm, prompt, SpecConfig("mtp", 3, draft_vocab=size)) == plain_greedy(lm, prompt, 60)
    assert vocab_rank.ranking(lm).mass is not None  # the subset came from the counted ranking


def ranking_with(mass):
    mass = np.asarray(mass, dtype=np.float64)
    return vocab_rank.Ranking(np.lexsort((np.arange(len(mass)), -mass)), mass, "test")


def test_auto_takes_the_tokens_carrying_nine_tenths_of_the_mass_in_steps_of_256():
    vocab = 8192
    mass = np.zeros(vocab)
    mass[:1000] = 1.0  # total 1100: 90% of it on the first 990 tokens, 1024 after rounding
    mass[1000:] = 100.0 / (vocab - 1000)
    assert auto_size(ranking_with(mass), vocab) == 1024
    mass[:2000] = 1.0  # 2000 tokens carry it: 2048
    mass[2000:] = 0.0
    assert auto_size(ranking_with(mass), vocab) == 2048
    assert auto_size(ranking_with(np.r_[1.0, np.zeros(vocab - 1)]), vocab) == 1024  # at least 1/8 of the vocabulary
    assert auto_size(ranking_with(np.ones(vocab)), vocab) is None  # mass spread evenly: keep the whole
    assert auto_size(vocab_rank.id_order(vocab), vocab) is None  # no counts: keep the whole


def test_auto_on_the_bundled_model_comes_from_its_shipped_ranking_deterministically():
    from dyno_ui.paths import BUNDLED_MODEL
    from speculative.loader import load_checkpoint

    picks = []
    for _ in range(2):
        lm = load_checkpoint(BUNDLED_MODEL)
        notices = []
        picks.append(resolve(lm, AUTO, notices.append))
        assert notices == [] and vocab_rank.ranking(lm).source == str(BUNDLED_MODEL / vocab_rank.FILE)
        projection = draft_lm_head(lm, AUTO)
        assert isinstance(projection, DraftLMHead) and projection.ids.size == picks[-1]
        assert projection is draft_lm_head(lm, picks[-1])
    assert picks[0] == picks[1] == 1792


def test_auto_keeps_a_small_vocabulary_whole_without_ranking_it(tiny_dir):
    from speculative.loader import load_checkpoint

    lm = load_checkpoint(tiny_dir())
    assert lm.target.args.vocab_size < AUTO_MIN_VOCAB
    assert resolve(lm, AUTO, lambda m: pytest.fail(m)) is None and draft_lm_head(lm, AUTO) == lm.target.lm_head
    assert lm.target not in vocab_rank._ranked and resolve(lm, 50) == 50


def test_the_bundled_model_drafts_exactly_and_well_from_its_auto_vocabulary():
    from dyno_ui.paths import BUNDLED_MODEL
    from speculative.loader import load_checkpoint
    from speculative.stats import GenerationStats

    lm = load_checkpoint(BUNDLED_MODEL)
    prompt = lm.tokenizer.encode('def read_config(path):\n    """Read the config file at path."""\n')
    accepted = {}
    for size in (None, AUTO, 512):
        stats = GenerationStats()
        for e in generate(lm, prompt, SamplingParams(max_tokens=80), SpecConfig("mtp", 2, draft_vocab=size)):
            stats.add(e)
        accepted[size] = stats.accepted_tokens
        assert stats.tokens == plain_greedy(lm, prompt, 80)
    assert accepted[AUTO] >= 0.9 * accepted[None] and accepted[512] > 0.5 * accepted[None]


def test_the_draft_projection_is_built_once_per_model_and_size(tiny_lm):
    lm = tiny_lm()
    assert draft_lm_head(lm, 50) is draft_lm_head(lm, 50)
    assert draft_lm_head(lm, None) == lm.target.lm_head and draft_lm_head(lm, 10**6) == lm.target.lm_head


@pytest.mark.parametrize("bad", [0, -3, 2.5, "many", "full", "Auto"])
def test_a_bad_draft_vocabulary_is_refused(bad):
    with pytest.raises(DynoError, match="draft vocabulary must be a number of tokens >= 1, auto or full, got "):
        SpecConfig("mtp", 2, draft_vocab=bad)
    assert SpecConfig("mtp", 2, draft_vocab=AUTO).draft_vocab == AUTO
