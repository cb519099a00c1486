"""Head rows whose outputs nothing reads (a prompt's, those plain rounds owe) go into the head's
cache as the whole head pass puts them (MTPHead.remember)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

TOKENS = [[3, 17, 9, 41, 5, 23, 8, 30], [11, 2, 7, 7, 19, 4, 60, 1]]


def inputs(lm, rows):
    tokens = mx.array(rows)
    return lm.target.embed(tokens), lm.target.hidden(tokens, lm.target.make_cache())


def same_caches(a, b):
    for x, y in zip(a, b):
        assert mx.array_equal(x.offset, y.offset)
        for u, v in zip(x.state, y.state):
            assert mx.array_equal(u, v)


@pytest.mark.parametrize("name", ["tied-gqa2", "moe-fused"])
def test_remembered_rows_are_the_whole_pass_rows(tiny_lm, name):
    lm = tiny_lm(name)
    emb, hidden = inputs(lm, TOKENS[:1])
    whole, remembered = lm.head.make_cache(), lm.head.make_cache()
    for s, e in [(0, 5), (5, 7)]:  # in chunks, as a prefill feeds them
        lm.head(emb[:, s:e], hidden[:, s:e], whole)
        lm.head.remember(emb[:, s:e], hidden[:, s:e], remembered)
    same_caches(whole, remembered)
    # The row that drafts next reads them alike.
    assert mx.array_equal(lm.head(emb[:, 7:], hidden[:, 7:], whole),
                          lm.head(emb[:, 7:], hidden[:, 7:], remembered))


def test_remembered_rows_of_a_left_padded_batch(tiny_lm):
    lm = tiny_lm()
    emb, hidden = inputs(lm, TOKENS)
    whole, remembered = ([BatchKVCache([2, 0]) for _ in lm.head.layers] for _ in range(2))
    lm.head(emb[:, :6], hidden[:, :6], whole)
    lm.head.remember(emb[:, :6], hidden[:, :6], remembered)
    same_caches(whole, remembered)
    assert mx.array_equal(lm.head(emb[:, 6:], hidden[:, 6:], whole),
                          lm.head(emb[:, 6:], hidden[:, 6:], remembered))
