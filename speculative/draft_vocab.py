"""A draft vocabulary: the draft step's lm_head restricted to the tokens the model is likely to write.

The projection onto the vocabulary is most of a draft step's cost on real models (a 248k-row
lm_head). Drafts only need likely tokens, so the draft step multiplies by a slice of the lm_head
rows and leaves every other token at -inf. The verify pass keeps the full vocabulary, so output
stays exact: a greedy draft is only a guess, and a sampled draft's q is the warped distribution
over the subset (zero outside it), which the lossless rule handles like any other q.

Ranking: byte-level BPE ids follow merge order, and merges are made most frequent first, so the
lowest ids are the most frequent tokens; special and added tokens (end of turn, think and tool-call
tags) are always kept whatever their id.
"""

import weakref
from typing import Iterable, List, Optional

import mlx.core as mx

FULL = None  # no restriction: the draft step uses the whole lm_head

_built: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {size: DraftLMHead}


def special_ids(tokenizer, vocab: int) -> List[int]:
    """Ids of the tokenizer's special and added tokens (and EOS) below `vocab`."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids.update(getattr(tokenizer, "eos_token_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(added.keys())
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < vocab)


def ranked_ids(tokenizer, vocab: int, size: int) -> List[int]:
    """The `size` draft token ids: every special token, then the lowest (most frequent) ids; sorted."""
    keep = set(special_ids(tokenizer, vocab))
    for i in range(vocab):
        if len(keep) >= size:
            break
        keep.add(i)
    return sorted(keep)


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


def lm_head_module(target):
    """The module whose rows are the vocabulary: the lm_head, or the embedding when tied."""
    return target.body.embed_tokens if target.args.tie_word_embeddings else target.text.lm_head


def draft_lm_head(lm, size: Optional[int]):
    """The draft step's vocabulary projection for `size` tokens (FULL or >= vocab: the trunk's own)."""
    vocab = lm.target.args.vocab_size
    split = getattr(lm.target.text, "sharding_group", None) is not None  # tensor parallel: rows across ranks
    if size is FULL or size >= vocab or split:
        return lm.target.lm_head
    per_target = _built.setdefault(lm.target, {})
    if size not in per_target:  # slicing the rows copies them once per model and size
        per_target[size] = DraftLMHead(lm_head_module(lm.target), ranked_ids(lm.tokenizer, vocab, size), vocab)
    return per_target[size]
