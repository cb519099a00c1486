"""A draft vocabulary: the draft step's lm_head restricted to the tokens the model is likely to write.

The projection onto the vocabulary is most of a draft step's cost on real models (a 248k-row
lm_head). Drafts only need likely tokens, so the draft step multiplies by a slice of the lm_head
rows and leaves every other token at -inf. The verify pass keeps the full vocabulary, so output
stays exact: a greedy draft is only a guess, and a sampled draft's q is the warped distribution
over the subset (zero outside it), which the lossless rule handles like any other q.

Which tokens: the first N of the model's ranking (rank.py: by the mass the model puts on each
token in its own continuations), and always the special and added tokens (end of turn, think and
tool-call tags) whatever their rank. `auto` picks N from that ranking (auto_size).
"""

import math
import weakref
from typing import Iterable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import rank

FULL = None  # no restriction: the draft step uses the whole lm_head
AUTO = "auto"  # N from the ranking's counted mass (auto_size)
# auto: the fewest tokens carrying AUTO_MASS of the mass the model put on its own continuations. On
# dyno-tiny 0.9 (1,792 tokens) kept position-1 acceptance within 0.4 points of the full vocabulary on
# every text measured, 0.82 (1,024) within 0.9: too thin a margin for a ranking from ~4,300 positions
# (docs/performance.md, Draft vocabulary). Unmeasured on larger models, hence a floor of
# AUTO_MIN_SHARE of the vocabulary (vocabulary-pruned draft heads keep 32K-98K of Qwen's 248K
# tokens: prior-art.md).
# Rounded up to AUTO_STEP: a ranking from a few thousand positions is noisy by tens of tokens.
AUTO_MASS = 0.9
AUTO_MIN_SHARE = 1 / 8
AUTO_STEP = 256
# Past this share the model spreads its mass too evenly for the ranking to tell which tokens it will
# write (random test models do): the whole vocabulary keeps acceptance.
AUTO_MAX_SHARE = 0.75
# Below this a byte-level vocabulary is mostly its 256 single bytes and ~30 special tokens: a subset has
# little to leave out, so auto keeps the whole one without ranking it.
AUTO_MIN_VOCAB = 1024

_built: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {size: DraftLMHead}


def special_ids(tokenizer, vocab: int) -> List[int]:
    """Ids of the tokenizer's special and added tokens (and EOS) below `vocab`."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids.update(getattr(tokenizer, "eos_token_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(added.keys())
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < vocab)


def ranked_ids(tokenizer, vocab: int, size: int, order: Optional[Sequence[int]] = None) -> List[int]:
    """The `size` draft token ids: every special token, then the first of `order` (default: the
    lowest ids, the earliest merges); sorted."""
    keep = set(special_ids(tokenizer, vocab))
    for i in range(vocab) if order is None else order:
        if len(keep) >= size:
            break
        keep.add(int(i))
    return sorted(keep)


def auto_size(ranking: "rank.Ranking", vocab: int) -> Optional[int]:
    """N for `auto` (see AUTO_MASS), or FULL: without counts (the id order says nothing of what the
    model writes) or when N would pass AUTO_MAX_SHARE of the vocabulary."""
    if ranking.mass is None:
        return FULL
    cumulative = np.cumsum(ranking.mass[ranking.order])
    n = max(int(np.searchsorted(cumulative, AUTO_MASS * cumulative[-1])) + 1, math.ceil(AUTO_MIN_SHARE * vocab))
    n = -(-n // AUTO_STEP) * AUTO_STEP
    return n if n <= AUTO_MAX_SHARE * vocab else FULL


class DraftLMHead:
    """The trunk's lm_head on a subset of rows, returning full-width logits (-inf off the subset)."""

    def __init__(self, module, ids: Iterable[int], vocab: int):
        self.vocab = vocab
        self.ids = mx.array(list(ids), dtype=mx.uint32)  # [N], sorted
        self.weight = module.weight[self.ids]  # [N, H] or packed [N, H * bits / 32]
        self.scales = module.scales[self.ids] if hasattr(module, "scales") else None
        biases = getattr(module, "biases", None)
        self.biases = biases[self.ids] if self.scales is not None and biases is not None else None
        self.quant = dict(group_size=module.group_size, bits=module.bits,
                          mode=getattr(module, "mode", "affine")) if self.scales is not None else None
        mx.eval(self.weight, *(a for a in (self.scales, self.biases) if a is not None))

    def subset_logits(self, hidden: mx.array) -> mx.array:
        """[..., N] logits of the subset's tokens."""
        if self.quant is None:
            return hidden @ self.weight.T
        return mx.quantized_matmul(hidden, self.weight, self.scales, self.biases, transpose=True, **self.quant)

    def __call__(self, hidden: mx.array) -> mx.array:
        """[B, V] logits from [B, H] hiddens: the subset's, -inf elsewhere (the processors and the warp
        then see the same full-width row shape as the verify pass's)."""
        sub = self.subset_logits(hidden)
        full = mx.full((*sub.shape[:-1], self.vocab), -mx.inf, dtype=sub.dtype)
        index = mx.broadcast_to(self.ids.astype(mx.int32), sub.shape)
        return mx.put_along_axis(full, index, sub, axis=-1)

    def greedy(self, hidden: mx.array) -> mx.array:
        """[B] greedy draft tokens from [B, H] hiddens: the argmax of __call__'s row without building
        it (off-subset tokens are -inf there; ids are sorted, so ties still go to the lowest id)."""
        return self.ids[mx.argmax(self.subset_logits(hidden), axis=-1)]


def greedy_token(projection, hidden: mx.array) -> mx.array:
    """[B] greedy draft tokens through `projection` (draft_lm_head's): a subset's without the full row."""
    if isinstance(projection, DraftLMHead):
        return projection.greedy(hidden)
    return mx.argmax(projection(hidden), axis=-1)


def lm_head_module(target):
    """The module whose rows are the vocabulary: the lm_head, or the embedding when tied."""
    return target.body.embed_tokens if target.args.tie_word_embeddings else target.text.lm_head


def _whole(lm, size) -> bool:
    """True when `size` leaves the trunk's lm_head as it is, without ranking anything."""
    vocab = lm.target.args.vocab_size
    if size == AUTO:
        return vocab < AUTO_MIN_VOCAB
    # tensor parallel: the lm_head's rows are spread across ranks, a slice of them is no draft head
    return size is FULL or size >= vocab or getattr(lm.target.text, "sharding_group", None) is not None


def resolve(lm, requested, notify=None) -> Optional[int]:
    """The number of draft tokens `requested` (N, FULL or AUTO) means for this model (None: all), with
    its ranking loaded or derived now, so that the notices come while the model loads (to `notify`)."""
    if lm.head is None or lm.target is None or _whole(lm, requested):
        return FULL if requested == AUTO else requested
    ranking = rank.ranking(lm, notify)
    return auto_size(ranking, lm.target.args.vocab_size) if requested == AUTO else requested


def draft_lm_head(lm, size):
    """The draft step's vocabulary projection for `size` tokens (FULL or >= vocab: the trunk's own;
    AUTO: auto_size's N)."""
    vocab = lm.target.args.vocab_size
    if size == AUTO:
        size = resolve(lm, AUTO)
    if _whole(lm, size):
        return lm.target.lm_head
    per_target = _built.setdefault(lm.target, {})
    if size not in per_target:  # slicing the rows copies them once per model and size
        order = rank.ranking(lm).order
        per_target[size] = DraftLMHead(lm_head_module(lm.target), ranked_ids(lm.tokenizer, vocab, size, order), vocab)
    return per_target[size]
