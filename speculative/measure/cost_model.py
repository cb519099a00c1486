"""The cost model: seconds per 1-token trunk step (T1), per k+1-token verify (Tv(k)) and per head
step (Td) on this model and machine, and the speedup they allow: E / (Tv(k)/T1 + k*Td/T1).

`--draft-depth auto` uses it (speculative/measure/tuning.py) without importing the benchmark.
"""

import statistics
import time
from typing import Dict, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..rollback import restore, snapshot
from ..draft_vocab.head import draft_lm_head, greedy_token
from ..loader import LoadedModel


def queued(build, n: int) -> float:
    """Seconds for n calls of `build` queued back to back, the last one waited for."""
    start = time.perf_counter()
    out = None
    for _ in range(n):
        out = build()
        mx.async_eval(out)
    mx.eval(out)
    return time.perf_counter() - start


def per_call(build, burst: int) -> float:
    """Seconds per call of `build` run back to back the way a decoding loop runs it.

    mlx-lm's generate_step builds step n+1 while step n computes (async_eval); timing each call
    with a blocking eval would charge the graph building to the model and inflate T1 (by about
    8% on this machine). A run of n queued calls still exposes its first build and last wait,
    so the difference of runs of 2n and n calls is taken: the edges cancel.
    """
    return (queued(build, 2 * burst) - queued(build, burst)) / burst


def interleaved(builds: Dict[object, object], reps: int, burst: int = 2, warmup: int = 2) -> Dict[object, float]:
    """Median seconds per call of each graph builder, timed round-robin.

    This machine's speed drifts by tens of percent within seconds; timing one function's reps
    in a block and the next one's later would put that drift into their ratios (the bound).
    """
    for _ in range(warmup):  # graph compile and allocation
        for build in builds.values():
            queued(build, 1)
    samples = {name: [] for name in builds}
    for _ in range(reps):
        for name, build in builds.items():
            samples[name].append(per_call(build, burst))
    medians = {name: statistics.median(v) for name, v in samples.items()}
    # A difference of two timed runs that the machine's noise made zero or negative says nothing
    # (and a negative cost turns the bound negative): one call timed alone, its graph building
    # included and so rather more, stands in for it.
    return {name: s if s > 0 else queued(builds[name], 1) for name, s in medians.items()}


def verify_call(target, trunk, last: mx.array, k: int, rope=None):
    """A builder of one k+1-token verify of `last` repeated, on `trunk` rewound after it (every layer's
    state kept in the result, so the whole pass is waited for)."""
    snap = snapshot(trunk)

    def build():
        logits, _, tapes = target.verify(mx.repeat(last, k + 1, axis=1), trunk, rope)
        restore(trunk, snap)
        return [mx.argmax(logits, axis=-1)] + [t.states[-1] if t.states else t.conv_input for t in tapes]
    return build


def draft_call(target, head, head_cache, last: mx.array, hidden: mx.array, projection, rope=None):
    """A builder of one head step from (`last`, `hidden`) and its greedy pick through `projection`, as
    a greedy draft picks, on `head_cache` trimmed back after it."""
    offset = head_cache[0].offset

    def build():
        out = head(target.embed(last), hidden, head_cache, rope=rope)
        head_cache[0].trim(head_cache[0].offset - offset)
        return greedy_token(projection, out[:, -1])
    return build


def cost_model(lm: LoadedModel, prompt: Sequence[int], depths: Sequence[int], reps: int = 15,
               burst: int = 2, draft_vocab: Optional[int] = None,
               other_projections: Optional[Dict[str, object]] = None,
               context: Optional[int] = None) -> Dict[str, object]:
    """Seconds per 1-token trunk step (T1), per k+1-token verify (Tv(k)) and per head step (Td).

    Each builder queues one call's graph and rewinds the caches, so back-to-back calls all
    see the same context. `other_projections` (name -> a draft projection, e.g. a DraftLMHead):
    a head step through each is timed in the same rounds, as "Td_other" {name: seconds}.
    `context`: every attention cache (trunk and head) padded to that many rows after the prompt
    (pad_attention), for long contexts without their prefill.
    """
    return cost_timer(lm, prompt, depths, draft_vocab, other_projections, context)(reps, burst)


def cost_timer(lm: LoadedModel, prompt: Sequence[int], depths: Sequence[int], draft_vocab: Optional[int] = None,
               other_projections: Optional[Dict[str, object]] = None, context: Optional[int] = None):
    """cost_model's calls built once on their own caches: a function of (reps, burst, warmup) that times
    them again, so a benchmark can time the model calls beside each of its runs."""
    target, head = lm.target, lm.head
    draft_projection = draft_lm_head(lm, draft_vocab)  # what the draft step multiplies by
    trunk = target.make_cache()
    tokens = mx.array(list(prompt))[None]
    hidden = target.hidden(tokens, trunk)
    head_cache = head.make_cache()
    head(target.embed(tokens), hidden, head_cache)
    if context:
        pad_attention(trunk + head_cache, context)
    mx.eval([c.state for c in trunk + head_cache])
    snap = snapshot(trunk)
    last = tokens[:, -1:]

    def step():
        out = mx.argmax(target.lm_head(target.hidden(last, trunk)), axis=-1)
        restore(trunk, snap)
        return out

    g = hidden[:, -1:]

    def draft(projection):
        return draft_call(target, head, head_cache, last, g, projection)

    others = {("Td", name): draft(p) for name, p in (other_projections or {}).items()}
    builds = {"T1": step, "Td": draft(draft_projection), **{k: verify_call(target, trunk, last, k) for k in depths},
              **others}

    def time_calls(reps: int, burst: int = 2, warmup: int = 2) -> Dict[str, object]:
        t = interleaved(builds, reps, burst, warmup)
        costs = {"T1": t["T1"], "Tv": {k: t[k] for k in depths}, "Td": t["Td"]}
        if others:
            costs["Td_other"] = {name: t[("Td", name)] for name in other_projections}
        return costs
    return time_calls


def pad_attention(caches, length: int, seed: int = 0) -> None:
    """Grow every KVCache in `caches` to `length` rows of random keys and values.

    An attention call costs what its key count makes it cost, whatever the keys hold, and the
    recurrent (GDN) layers' state has one size at any length: so a padded cache times a step at
    `length` tokens of context without a prefill that takes minutes on a CPU.
    """
    key = mx.random.key(seed)
    for c in caches:
        if not isinstance(c, KVCache) or c.offset >= length:
            continue
        b, heads, _, d = c.keys.shape
        key, k1, k2 = mx.random.split(key, 3)
        n = length - c.offset
        c.update_and_fetch(mx.random.normal((b, heads, n, d), dtype=c.keys.dtype, key=k1),
                           mx.random.normal((b, heads, n, c.values.shape[-1]), dtype=c.values.dtype, key=k2))
        mx.eval(c.keys, c.values)


def speedup_bound(tokens_per_round: float, t1: float, tv: float, td: float, k: int) -> float:
    """E / (Tv(k)/T1 + k*Td/T1): what the model calls alone allow."""
    return tokens_per_round / (tv / t1 + k * td / t1)
