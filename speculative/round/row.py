"""One request's row in a speculative round: what it has emitted, how it picks and accepts tokens.

A Row holds what belongs to its request alone (the prompt and tokens so far, the sampling parameters
and processors, the RNG, a pinned draft depth); the round (round.py) holds what the rows share (the
caches, pending tokens and head outputs, one row of each per request) and runs every row at once.
"""

import random
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .processors import PrefixProcessors
from .sampling import KeyChain, draft_params, draw, log_softmax, seeded_pick, warp
from .scoring import scored
from .verify import agreeing_accept, greedy_accept, lossless_accept


class Row:
    """One request in the round: its prompt, emitted tokens, rules and randomness."""

    def __init__(self, params, eos: Sequence[int], vocab: int, depth: Optional[int] = None,
                 rng_seed: Optional[int] = None):
        """`params`: the request's SamplingParams; `eos`: the token ids that end it; `rng_seed`: the
        unseeded draws' seed (drawn here when None)."""
        self.id = None  # the request's id in its batch
        self.head_shift = 0  # head cache positions it joined without (ShiftedKVCache.start)
        self.params = params
        self.depth = depth  # pinned by its request (whatever the others draft); None: the policy's
        self.chosen: Optional[int] = None  # its own depth this round (row_depth.RowDepth), at most the round's
        self.copies: Optional[str] = None  # its request's draft source (copies.SOURCES); None: the drafter's
        self.eos = set(eos)
        self.draft_params = draft_params(params, vocab)  # q's warp (any q is exact)
        self.processors = PrefixProcessors(params)
        seed = params.seed if params.seed is not None else rng_seed
        seed = random.getrandbits(32) if seed is None else seed
        self.key = mx.random.key(seed)
        # A seeded sampled request draws as plain mlx-lm does: token i with the seed's i-th key, drafts
        # with their positions' keys, kept while they equal the trunk's draws (sampling.seeded_pick).
        # Unseeded requests keep the lossless min(1, p/q) rule, which accepts more.
        self.keys = KeyChain(params.seed) if params.seed is not None and not params.greedy else None
        self.prompt: List[int] = []
        self.generated: List[int] = []  # tokens emitted so far (the last one is still uncached)
        # Per emitted token of the latest prefill or round, its TokenLogprobs (None when not asked for).
        self.scores: List = []
        self.checkpoints: Dict = {}  # its prompt's recurrent-state checkpoints, kept by the prefix cache
        self.details = False  # its Rounds also carry each draft's p, q and acceptance chance (RoundDetails)
        self.rope = None  # an image prompt's positions (target.MRoPE); None: a text row, mlx-lm's RoPE
        self.cache_key: Optional[List[int]] = None  # an image prompt as the prompt cache keys it (VisionInput.key)

    @property
    def plain_greedy(self) -> bool:
        """Greedy without logits processors: its pick is the argmax alone (rows like it share one)."""
        return self.params.greedy and not self.processors

    def split(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def history(self) -> mx.array:
        """What the logits processors see of the committed tokens (prompt, then generated)."""
        return self.processors.tail(self.prompt, self.generated)

    def process(self, rows: mx.array, drafts: Optional[mx.array] = None) -> mx.array:
        """Logits processors on [T, V] rows, row i following the committed tokens and drafts[:i]."""
        if not self.processors:
            return rows
        return self.processors.rows(rows, self.history(), drafts)

    def pick(self, logits: mx.array, ahead: int = 0):
        """(token, draft distribution) for a [1, V] logits row drafting the token `ahead` places past the
        ones generated; greedy drafts need no distribution."""
        if self.params.greedy:
            return mx.argmax(logits, axis=-1), None
        if self.keys is not None:  # p's own warp and the position's key: the draft the trunk would draw
            key = self.keys[len(self.generated) + ahead]
            return seeded_pick(logits, self.params, key), mx.exp(warp(logits, self.params))
        logprobs = warp(logits, self.draft_params)
        return draw(logprobs, self.split()), mx.exp(logprobs)

    def pick_target(self, logits: mx.array, ahead: int = 0) -> mx.array:
        """The trunk's token for a [1, V] logits row, `ahead` places past the ones generated: argmax
        when greedy, else a draw from the warp (seeded: with that position's key)."""
        if self.params.greedy:
            return mx.argmax(log_softmax(logits), axis=-1)
        if self.keys is not None:
            return seeded_pick(logits, self.params, self.keys[len(self.generated) + ahead])
        return draw(warp(logits, self.params), self.split())

    def seeded_tokens(self, rows: mx.array) -> mx.array:
        """The trunk's own draws for processed verify rows [k + 1, V]: row i is the token i past the
        ones generated, drawn with that position's key (one call per row: sampling.seeded_pick)."""
        return mx.concatenate([self.pick_target(rows[i : i + 1], i) for i in range(rows.shape[0])])

    def accept(self, logits: mx.array, drafts: mx.array,
               draft_probs: Optional[mx.array]) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """This row's rule over its [k + 1, V] verify logits and [k] drafts: (accepted count, next token,
        processed logits, target rows: log-probabilities when greedy, else p)."""
        rows = self.process(logits, drafts)  # the processors the drafts saw, per row
        if self.params.greedy:
            target = log_softmax(rows)
            n, t = greedy_accept(drafts, target)
        else:
            target = mx.exp(warp(rows, self.params))  # seeded, read only by details and the health check
            if drafts.shape[0] == 0:  # nothing drafted: the trunk's own token
                n, t = mx.array(0), self.pick_target(rows)[0]
            elif self.keys is not None:  # plain mlx-lm's own draws, the drafts kept while they agree
                n, t = agreeing_accept(drafts, self.seeded_tokens(rows))
            else:
                n, t = lossless_accept(drafts, draft_probs, target, self.split())
        return n, t, rows, target

    def scored(self, logits: mx.array, tokens: List[int]):
        """TokenLogprobs of `tokens`, row i of the processed `logits` for token i (None each when off)."""
        return scored(log_softmax(logits) if self.params.logprobs is not None else None, tokens,
                      self.params.logprobs)

    def finish(self, n: int) -> Optional[str]:
        """Why the request ends after its n-th token, or None."""
        if self.generated[n - 1] in self.eos:
            return "stop"
        if n >= self.params.max_tokens:
            return "length"
        return None
