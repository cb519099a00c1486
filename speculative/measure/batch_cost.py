"""Measuring the batched round's costs on this model and machine (V, D and whole rounds, the
cost model of round/depth_policy.py), and the policy a server starts with (resolve_policy)."""

import time
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ..batched import BatchSpeculator, Joiner
from ..config import SamplingParams
from ..draft_vocab.head import greedy_token
from ..errors import DynoError
from ..loader import LoadedModel
from ..rollback import restore, snapshot
from ..round.depth_policy import MAX_DEPTH, BatchCosts, DepthPolicy, typical
from .cost_model import interleaved
from .tuning import ESTIMATE_PROMPT, PRIOR_DECAY, PRIOR_FIRST, resolve_depth, store, stored

WIDTHS = (1, 2, 4, 8)  # batch widths measured; others are interpolated


# ---- measuring on this model and machine ----

def measure_batch_costs(lm: LoadedModel, prompt: Sequence[int], widths: Sequence[int] = WIDTHS,
                        max_depth: int = MAX_DEPTH, reps: int = 5, burst: int = 1,
                        draft_vocab: Optional[int] = None,
                        make: Optional[Callable[[], BatchSpeculator]] = None) -> BatchCosts:
    """V(B, t) for t in 1..max_depth+1 and D(B), each B rows of `prompt` in a BatchSpeculator's caches
    (`make`'s, else one drafting over `draft_vocab`), then R(B, k), whole rounds run on those rows.

    Each builder queues one pass's graph and rewinds the caches, so every call sees the same context;
    the timing is cost_model's (round-robin bursts, medians).
    """
    builders = {}
    keep = []  # the batches stay alive while their builders are timed
    for width in widths:
        batch = make() if make is not None else BatchSpeculator(lm, draft_vocab=draft_vocab)
        joined = batch.join_all([Joiner(b, prompt, SamplingParams(max_tokens=1 << 20)) for b in range(width)])
        if len(batch) < width:  # a row that failed or ended at once: the width would not be the one timed
            why = next((out.error for out in joined.values() if out.error is not None), None)
            raise DynoError(f"cannot time {width} rows of the timing prompt: {why or 'it ends at its first token'}")
        keep.append(batch)
        builders.update(_builders(batch, width, max_depth))
    t = interleaved(builders, reps, burst)
    verify = {b: {n: t[("V", b, n)] for n in range(1, max_depth + 2)} for b in widths}
    rounds = {width: timed_rounds(batch, width, prompt, max_depth, reps) for width, batch in zip(widths, keep)}
    return monotone(BatchCosts(verify, {b: t[("D", b)] for b in widths}, rounds))


def timed_rounds(batch: BatchSpeculator, width: int, prompt: Sequence[int], max_depth: int,
                 reps: int) -> Dict[int, float]:
    """Seconds of whole rounds at each depth 0..max_depth, as a server runs them and as RoundClock
    times them: what V and D leave out (acceptance, rollback, the host sync) included, start to start.
    Depths take turns of three rounds, the middle one timed (the first pays the switch, the last
    queues the next depth's work); typical() of each depth's times. A row that ends is replaced; a
    turn with a replacement after its first round is not timed."""
    samples: Dict[int, List[float]] = {k: [] for k in range(max_depth + 1)}
    joined = len(batch)
    for _ in range(reps):
        for k in samples:
            starts, refilled = [], False
            for r in range(3):
                while len(batch) < width:
                    if batch.join(("refill", joined), prompt, SamplingParams(max_tokens=1 << 20)).finish:
                        raise DynoError("the timing prompt ends at its first token")
                    joined, refilled = joined + 1, refilled or r > 0  # before the switch round: no matter
                starts.append(time.perf_counter())
                batch.step(k, k if r < 2 else (k + 1) % (max_depth + 1))
            if not refilled:
                samples[k].append(starts[2] - starts[1])
    return {k: typical(v) for k, v in samples.items() if v}


def monotone(costs: BatchCosts) -> BatchCosts:
    """The costs made non-decreasing in tokens (or depth) and in rows (a running maximum): more work
    never costs less, and a timing the machine's noise pushed below a smaller pass's is that pass's."""
    ws = sorted(costs.draft)
    draft = {}
    for i, b in enumerate(ws):
        draft[b] = max(costs.draft[b], draft[ws[i - 1]] if i else 0.0)
    return BatchCosts(_running_max(costs.verify), draft, _running_max(costs.rounds) if costs.rounds else None)


def _running_max(table: Dict[int, Dict[int, float]]) -> Dict[int, Dict[int, float]]:
    ws = sorted(table)
    out = {}
    for i, b in enumerate(ws):
        row, floor = {}, 0.0
        for t in sorted(table[b]):
            floor = max(floor, table[b][t], out[ws[i - 1]][t] if i else 0.0)
            row[t] = floor
        out[b] = row
    return out


def _builders(batch: BatchSpeculator, width: int, max_depth: int) -> dict:
    target, head = batch.target, batch.head
    trunk, heads = batch.trunk_cache, batch.head_cache
    trunk_snap, head_snap = snapshot(trunk), snapshot(heads)
    pending, g = batch.pending[:, None], batch.head_hidden

    def plain():  # a depth-0 round: mlx-lm's forward over one token per row
        out = mx.argmax(target.lm_head(target.hidden(pending, trunk)), axis=-1)
        restore(trunk, trunk_snap)
        return out

    def verify(t):
        def build():  # a drafting round's trunk pass and the head's rows after it
            tokens = mx.repeat(pending, t, axis=1)
            logits, hidden, tapes = target.verify(tokens, trunk)
            rows = head(target.embed(tokens), hidden, heads)
            restore(trunk, trunk_snap)
            restore(heads, head_snap)
            return [mx.argmax(logits, axis=-1), rows] + [tp.states[-1] if tp.states else tp.conv_input for tp in tapes]
        return build

    def draft():  # one draft step: the pick and the head's next row
        d = greedy_token(batch.draft_lm_head, g[:, -1])
        out = head(target.embed(d[:, None]), g, heads)
        restore(heads, head_snap)
        return out

    out = {("V", width, 1): plain, ("D", width): draft}
    out.update({("V", width, t): verify(t) for t in range(2, max_depth + 2)})
    return out


def prior_acceptance(lm: LoadedModel, draft_vocab: Optional[int] = None) -> List[float]:
    """Acceptance by position before any round: the tuned or estimated one stored, else the prior."""
    found = stored(lm, draft_vocab) or {}
    return list(found.get("acceptance") or [PRIOR_FIRST * PRIOR_DECAY**i for i in range(MAX_DEPTH)])


def resolve_policy(lm: LoadedModel, requested, draft_vocab: Optional[int] = None,
                   notify: Callable[[str], None] = lambda message: None) -> DepthPolicy:
    """`--draft-depth N`: a policy pinned at N; "auto": the costs `dyno tune` stored, else a quick
    measurement (seconds; stored with the entry, so the next start reads it), announced by `notify`."""
    if requested != "auto":
        return DepthPolicy(None, [], pinned=int(requested))
    found = stored(lm, draft_vocab)
    if not found:  # the single-request estimate first: its acceptance is this policy's prior
        resolve_depth(lm, "auto", draft_vocab)
        found = stored(lm, draft_vocab) or {}
    prior = prior_acceptance(lm, draft_vocab)
    single = int(found.get("depth", 1))
    if found.get("batch_costs"):
        return DepthPolicy(BatchCosts.from_json(found["batch_costs"]), prior, single=single)
    notify("dyno: timing batched rounds of this model on this machine, once (stored for later starts; "
           "--decode-concurrency 1 serves without them)")
    prompt = lm.tokenizer.encode(ESTIMATE_PROMPT) or [0]
    costs = measure_batch_costs(lm, prompt, reps=3, draft_vocab=draft_vocab)
    details = {k: v for k, v in found.items() if k not in ("depth", "draft_vocab")}
    store(lm, single, {**details, "batch_costs": costs.as_json()}, draft_vocab)
    return DepthPolicy(costs, prior, single=single)
