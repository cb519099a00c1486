"""Generation: plain decoding through mlx-lm, or MTP draft -> verify -> accept -> rollback.

Both paths are generators of events (Token, Round, Done); text, streaming and statistics are
layers above. The speculative round is `_round`; prefill and stopping live outside it.
"""

import random
import time
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from .cache import rollback
from .config import SamplingParams, SpecConfig
from .events import Done, Provenance, Round, Token
from .loader import LoadedModel
from .sampling import draw, log_softmax, warp
from .verify import greedy_accept, lossless_accept

Event = Union[Token, Round, Done]
PREFILL_STEP = 2048  # mlx-lm's generate_step default; the same chunking keeps caches identical


def generate(
    lm: LoadedModel,
    prompt: Sequence[int],
    params: SamplingParams,
    spec: SpecConfig = SpecConfig(),
    prefill_step: int = PREFILL_STEP,
) -> Iterator[Event]:
    """Generate from `prompt` token ids; drafts with the MTP head unless off or headless."""
    if len(prompt) == 0:
        from .errors import DynoError

        raise DynoError("the prompt is empty")
    if spec.mode != "off" and lm.head is not None:
        steps = Speculator(lm, params, spec.draft_depth, prefill_step).run(list(prompt))
    else:
        steps = _plain(lm, prompt, params, prefill_step)
    yield from _until_stop(steps, lm.eos_token_ids, params.max_tokens, len(prompt))


def _until_stop(steps, eos: set, max_tokens: int, n_prompt: int) -> Iterator[Event]:
    """Cut the token stream at EOS or max_tokens and add timing; the stream is a fold of this."""
    start = time.perf_counter()
    first_at = last_at = None
    n = 0
    reason = "length"
    for event in steps:
        if isinstance(event, Round):
            yield event
            continue
        now = time.perf_counter()
        first_at = first_at or now
        last_at = now
        n += 1
        yield event
        if event.id in eos:
            reason = "stop"
            break
        if n >= max_tokens:
            break
    prefill = (first_at or start) - start
    decode = (last_at or start) - (first_at or start)
    steps.close()
    yield Done(reason, n_prompt, n, prefill, decode)


def _plain(lm: LoadedModel, prompt, params: SamplingParams, prefill_step: int):
    """Plain decoding is mlx-lm's own generate_step: same output, same speed."""
    if params.seed is not None:
        mx.random.seed(params.seed)
    sampler = make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)
    for token, _ in generate_step(
        mx.array(prompt), lm.model, max_tokens=-1, sampler=sampler, prefill_step_size=prefill_step
    ):
        yield Token(int(token), Provenance.PLAIN)


class Speculator:
    """State of one speculative generation: trunk and head caches, the pending token, the RNG."""

    def __init__(self, lm: LoadedModel, params: SamplingParams, depth: int, prefill_step: int):
        self.target, self.head = lm.target, lm.head
        self.params, self.depth, self.prefill_step = params, depth, prefill_step
        self.trunk_cache = self.target.make_cache()
        self.head_cache = self.head.make_cache()
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        self.key = mx.random.key(seed)
        self.generated: List[int] = []  # tokens emitted so far (the last one is still uncached)

    def _split(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def _head(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        """Head rows for [T] tokens with their [1, T, H] hiddens; returns post-norm [1, T, H]."""
        return self.head(self.target.embed(tokens[None]), hidden, self.head_cache)

    def _pick(self, logits: mx.array):
        """(token, draft distribution) for a [1, V] logits row; greedy drafts need no distribution."""
        if self.params.greedy:
            return mx.argmax(logits, axis=-1), None
        logprobs = warp(logits, self.params)
        return draw(logprobs, self._split()), mx.exp(logprobs)

    def prefill(self, prompt: List[int]):
        """Trunk over the prompt in mlx-lm's chunks, the head one row behind; returns t_n."""
        tokens = mx.array(prompt)
        n = len(prompt)
        for s in range(0, n - 1, self.prefill_step):
            e = min(s + self.prefill_step, n - 1)
            hidden = self.target.hidden(tokens[None, s:e], self.trunk_cache)
            self._head(tokens[s + 1 : e + 1], hidden)  # row p = (t_{p+1}, h_p)
            mx.eval([c.state for c in self.trunk_cache + self.head_cache])
        hidden = self.target.hidden(tokens[None, n - 1 :], self.trunk_cache)
        first, _ = self._pick_target(self.target.lm_head(hidden[:, -1]))
        self.head_hidden = self._head(first, hidden)[:, -1:]  # row n-1 drafts position n+1
        self.pending = first
        return first

    def _pick_target(self, logits: mx.array):
        if self.params.greedy:
            return mx.argmax(log_softmax(logits), axis=-1), None
        return draw(warp(logits, self.params), self._split()), None

    def _draft(self, k: int):
        """k head drafts by recursion: ([k] tokens, [k, V] draft probs or None when greedy)."""
        drafts, draft_probs = [], []
        g = self.head_hidden  # head post-norm output of the last committed row
        for j in range(k):
            d, q = self._pick(self.target.lm_head(g[:, -1]))
            drafts.append(d)
            draft_probs.append(q)
            if j + 1 < k:  # recurse: the draft token with the head's own output, position + 1
                g = self._head(d, g)
        probs = None if self.params.greedy else mx.concatenate(draft_probs)
        return mx.concatenate(drafts), probs

    def _round(self):
        """Draft k tokens, verify them in one trunk pass, keep the accepted prefix, roll back.

        Returns (accepted draft tokens, next token); next is the correction or the bonus.
        """
        k = self.depth
        cycle_start = self.head_cache[0].offset
        drafts, draft_probs = self._draft(k)
        logits, hidden, tapes = self.target.verify(
            mx.concatenate([self.pending, drafts])[None], self.trunk_cache
        )
        if self.params.greedy:
            n_acc, nxt = greedy_accept(drafts, log_softmax(logits[0]))
        else:
            target_probs = mx.exp(warp(logits[0], self.params))
            n_acc, nxt = lossless_accept(drafts, draft_probs, target_probs, self._split())
        mx.eval(n_acc, nxt, drafts)
        a = n_acc.item()
        rollback(self.trunk_cache, tapes, fed=k + 1, consumed=a + 1)
        for c in self.head_cache:  # drop the recursive rows: committed rows come from trunk hiddens
            c.trim(c.offset - cycle_start)
        nxt = nxt.reshape(1)
        committed = mx.concatenate([drafts[:a], nxt])
        self.head_hidden = self._head(committed, hidden[:, : a + 1])[:, -1:]
        self.pending = nxt
        accepted = drafts[:a].tolist()
        self.generated += accepted + [nxt.item()]
        return accepted, self.generated[-1]

    def run(self, prompt: List[int]) -> Iterator[Union[Token, Round]]:
        """Prefill, then rounds until the consumer stops iterating."""
        self.generated = [self.prefill(prompt).item()]
        yield Token(self.generated[0], Provenance.PLAIN)
        while True:
            accepted, nxt = self._round()
            yield Round(self.depth, len(accepted))
            for t in accepted:
                yield Token(t, Provenance.DRAFT)
            yield Token(nxt, Provenance.BONUS if len(accepted) == self.depth else Provenance.CORRECTION)
