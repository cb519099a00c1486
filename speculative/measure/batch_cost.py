"""Measuring the batched round's costs on this model and machine (V, D and whole rounds, the
cost model of round/depth_policy.py); depth.py decides from them."""

import time
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ..batched import BatchSpeculator, Joiner
from ..config import SamplingParams
from ..draft_vocab.head import greedy_token
from ..errors import DynoError
from ..loader import LoadedModel
from ..rollback import restore, snapshot
from ..round.depth_policy import BatchCosts, typical
from .cost_model import interleaved

WIDTHS = (1, 2, 4, 8)  # batch widths measured; others are interpolated
# Depths timed (the policy never drafts deeper than it has costs for): a chained head's acceptance
# rarely pays past 4, and timing to config.MAX_DRAFT_DEPTH (8) took 3x as long (65 s against 21 s
# for dyno-tiny on this 2-core machine).
TIMED_DEPTH = 4


# ---- measuring on this model and machine ----

def measure_batch_costs(lm: LoadedModel, prompt: Sequence[int], widths: Sequence[int] = WIDTHS,
                        max_depth: int = TIMED_DEPTH, reps: int = 5, burst: int = 1,
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
