"""Exact at long context (issue 54, item 4): a multi-turn session whose turns resume from the prompt
cache gives, token for token, what plain mlx-lm's generate_step gives cold on the whole
conversation; and whether prefill chunk boundaries change a prompt row's bits.

A cold mlx-lm run prefills the conversation in chunks of its prefill_step_size (2048) counted from
position 0; a resumed Dyno turn prefills from where its restored prefix ends, in chunks that also
end at each message boundary (batched.prefill.segments). `chunk_bits` computes a prompt both ways
and says how far apart the last row's logits and the caches came out.
"""

import random
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..batched.prefill import PREFILL_STEP, segments
from ..config import SamplingParams, SpecConfig
from ..engine import generate
from ..events import Done, Token
from ..loader import LoadedModel
from .bench import run_mlx_lm

# Prompt ids are drawn below this (and the vocabulary): ordinary tokens, clear of the specials a
# real vocabulary keeps at its end (images, tool calls), whose rows a text prompt never meets.
ORDINARY = 4000


def messages(n: int, rng: random.Random, vocab: int) -> List[int]:
    """`n` random ordinary token ids: a user message of the session."""
    return rng.choices(range(min(vocab, ORDINARY)), k=n)


def long_exact_session(lm: LoadedModel, cache, contexts: Sequence[int], answer_tokens: int = 16, depth: int = 3,
                       seed: int = 0, reference: Optional[Callable] = None) -> Iterator[dict]:
    """One conversation grown to each of `contexts` tokens in turn (a user message, then a greedy
    answer of up to `answer_tokens` drafted at `depth`), every turn after the first resumed from
    `cache` (an empty prompt_cache.PrefixCache); each turn's answer checked against
    `reference(lm, conversation, n)` (default: mlx-lm's generate_step, cold, on the whole
    conversation). Yields one dict per turn as it ends."""
    if any(b <= a for a, b in zip(contexts, contexts[1:])) or contexts[0] <= answer_tokens:
        raise ValueError(f"contexts must increase from above the answer's {answer_tokens} tokens: {list(contexts)}")
    reference = reference or (lambda lm, prompt, n: run_mlx_lm(lm, prompt, SamplingParams(max_tokens=n)).tokens)
    rng = random.Random(seed)
    conversation: List[int] = []
    starts: List[int] = []  # where each message starts: the chat boundaries the prompt cache checkpoints at
    for target in contexts:
        starts.append(len(conversation))
        conversation += messages(target - answer_tokens - len(conversation), rng, lm.vocab_size)
        start = time.perf_counter()
        events = list(generate(lm, conversation, SamplingParams(max_tokens=answer_tokens), SpecConfig("mtp", depth),
                               prefix_cache=cache, boundaries=starts[1:]))
        dyno_s = time.perf_counter() - start
        tokens = [e.id for e in events if isinstance(e, Token)]
        done = next(e for e in events if isinstance(e, Done))
        start = time.perf_counter()
        cold = reference(lm, conversation, answer_tokens)
        cold_s = time.perf_counter() - start
        same = tokens == cold
        first = None if same else next((i for i, (a, b) in enumerate(zip(tokens, cold)) if a != b),
                                       min(len(tokens), len(cold)))
        yield {"context": len(conversation) + len(tokens), "prompt_tokens": len(conversation),
               "restored": done.reused_prompt_tokens, "answer_tokens": len(tokens), "identical": same,
               "first_difference": first, "dyno_s": round(dyno_s, 2), "cold_s": round(cold_s, 2)}
        starts.append(len(conversation))  # the answer is a message too
        conversation += tokens


def _prefill(model, prompt: Sequence[int], ends: Sequence[int]):
    """The model over prompt[:-1] in chunks ending at `ends`, then the last token alone (as
    generate_step takes it): the last row's logits and the caches."""
    cache, s = make_prompt_cache(model), 0
    for e in ends:
        model(mx.array(list(prompt[s:e]))[None], cache=cache)
        mx.eval([c.state for c in cache])
        s = e
    logits = model(mx.array(list(prompt[-1:]))[None], cache=cache)[0, -1]
    mx.eval(logits, [c.state for c in cache])
    return logits, cache


def _held(cache):
    """What a cache holds: an attention cache's keys and values up to its offset (its buffer runs
    on, by steps), a recurrent cache's arrays."""
    if getattr(cache, "keys", None) is not None:
        return [cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]]
    return cache.state


def _apart(a, b) -> float:
    """Largest absolute difference of two arrays as float32 (0.0: the same bits, but for -0.0)."""
    return float(np.abs(np.array(a.astype(mx.float32)) - np.array(b.astype(mx.float32))).max())


def chunk_bits(lm: LoadedModel, prompt: Sequence[int], resumed_at: int, cuts: Sequence[int] = (),
               step: int = PREFILL_STEP) -> Dict[str, float]:
    """A prompt prefilled as mlx-lm's cold run chunks it (every `step` from 0) against as a Dyno turn
    resumed at `resumed_at` chunks it (the prefix as an earlier cold prompt, then batched.prefill's
    segments from there, ending at `cuts`): the largest differences of the last row's logits and of
    the caches (0.0 both: chunk boundaries change no bit of it)."""
    n = len(prompt)
    if not 0 < resumed_at < n - 1:
        raise ValueError(f"resumed_at must fall inside the prompt's first {n - 1} tokens: {resumed_at}")
    cold = list(range(step, n - 1, step)) + [n - 1]
    resumed = (list(range(step, resumed_at, step)) + [resumed_at]
               + [e for _, e in segments(resumed_at, n - 1, [c for c in cuts if resumed_at < c], step)])
    a, ca = _prefill(lm.model, prompt, cold)
    b, cb = _prefill(lm.model, prompt, resumed)
    states = [(x, y) for c, d in zip(ca, cb) for (_, x), (_, y) in zip(tree_flatten(_held(c)), tree_flatten(_held(d)))
              if x is not None]
    return {"logits": _apart(a, b), "caches": max(_apart(x, y) for x, y in states),
            "cold_ends": cold, "resumed_ends": resumed}
