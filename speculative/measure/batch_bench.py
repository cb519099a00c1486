"""Concurrent rows, engine level: the same prompts as N rows at once, Dyno batched drafting (with the
depth policy) against Dyno batched plain (depth 0), mlx-lm's own BatchGenerator and serial drafting
(one request after another), paired and alternating as measuring.md asks.

Every row starts at time 0 (the N requests arrive together); a row's latency is the time to its last
token, its TTFT the time to its first; the aggregate rate is all rows' tokens over the time to the last.
"""

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence

from mlx_lm.generate import BatchGenerator

from ..batched import BatchSpeculator, Joiner
from ..config import SamplingParams, SpecConfig
from ..engine import generate
from ..events import Token
from ..loader import LoadedModel
from .bench import summarize
from ..round.depth_policy import DepthPolicy, RoundTimer


@dataclass
class BatchRun:
    """One wave of N rows: each row's tokens, time to first and to last token, and the depths used."""

    tokens: List[List[int]]
    ttft: List[float]
    latency: List[float]
    depths: Dict[int, int] = field(default_factory=dict)  # depth -> rounds

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.latency)


def run_speculator(lm: LoadedModel, prompts: Sequence[Sequence[int]], params: SamplingParams,
                   depth_for: Callable[[int], int], observe: Callable = None,
                   draft_vocab=None, record: Callable = None, peek: Callable[[int], int] = None) -> BatchRun:
    """The rows through one BatchSpeculator: all join together (one prefill), then rounds at depth_for(width)."""
    start = time.perf_counter()
    batch = BatchSpeculator(lm, draft_vocab=draft_vocab)
    n = len(prompts)
    tokens, ttft, latency, depths = [[] for _ in range(n)], [0.0] * n, [0.0] * n, {}

    def take(i, out):
        tokens[i] += [e.id for e in out.events if isinstance(e, Token)]
        now = time.perf_counter() - start
        ttft[i] = ttft[i] or now
        latency[i] = now

    for i, out in batch.join_all([Joiner(i, prompt, params) for i, prompt in enumerate(prompts)]).items():
        take(i, out)
    timer = RoundTimer(record) if record is not None else None
    while batch:
        width, k = len(batch), depth_for(len(batch))
        then = peek(width) if peek is not None else k
        depths[k] = depths.get(k, 0) + 1
        if timer is not None:
            timer.start(width, k, then)
        outs = batch.step(k, then)
        for i, out in outs.items():
            take(i, out)
        if observe is not None:
            observe([e for out in outs.values() for e in out.events])
    return BatchRun(tokens, ttft, latency, depths)


def run_mlx_batch(lm: LoadedModel, prompts: Sequence[Sequence[int]], params: SamplingParams) -> BatchRun:
    """The rows through mlx-lm's own BatchGenerator (greedy, stopping at EOS), as its server batches."""
    start = time.perf_counter()
    n = len(prompts)
    gen = BatchGenerator(lm.model, stop_tokens=[[t] for t in lm.eos_token_ids],
                         completion_batch_size=n, prefill_batch_size=n)
    uids = gen.insert([list(p) for p in prompts], max_tokens=[params.max_tokens] * n)
    row = {u: i for i, u in enumerate(uids)}
    tokens, ttft, latency = [[] for _ in range(n)], [0.0] * n, [0.0] * n
    done = 0
    while done < n:
        for r in gen.next_generated():
            i = row[r.uid]
            now = time.perf_counter() - start
            tokens[i].append(int(r.token))
            ttft[i] = ttft[i] or now
            latency[i] = now
            done += r.finish_reason is not None
    gen.close()
    return BatchRun(tokens, ttft, latency)


def run_serial(lm: LoadedModel, prompts: Sequence[Sequence[int]], params: SamplingParams, spec: SpecConfig) -> BatchRun:
    """The rows one after another through the single-request speculator (Dyno's one-at-a-time server)."""
    start = time.perf_counter()
    n = len(prompts)
    tokens, ttft, latency = [[] for _ in range(n)], [0.0] * n, [0.0] * n
    for i, prompt in enumerate(prompts):
        for e in generate(lm, list(prompt), params, spec):
            if isinstance(e, Token):
                now = time.perf_counter() - start
                tokens[i].append(e.id)
                ttft[i] = ttft[i] or now
                latency[i] = now
    return BatchRun(tokens, ttft, latency)


def concurrent_benchmark(lm: LoadedModel, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         policy: DepthPolicy, serial_depth: int, pairs: int = 3,
                         draft_vocab=None) -> Dict[str, object]:
    """Alternate the four settings over `pairs` cycles after one warm-up cycle; per cycle, each
    setting's aggregate rate over plain batching's (Dyno at depth 0) and over mlx-lm's BatchGenerator."""
    settings = {
        "mlx-lm batch": lambda: run_mlx_batch(lm, prompts, params),
        "dyno plain": lambda: run_speculator(lm, prompts, params, lambda w: 0, draft_vocab=draft_vocab),
        "dyno drafting": lambda: run_speculator(lm, prompts, params, policy.depth_for, policy.observe, draft_vocab,
                                                 policy.record, policy.peek),
        "dyno serial": lambda: run_serial(lm, prompts, params, SpecConfig("mtp", serial_depth, draft_vocab)),
    }
    for run in settings.values():  # warm-up: compile, allocate; the policy sees its first rounds
        run()
    runs = {name: [] for name in settings}
    for _ in range(pairs):
        for name, run in settings.items():
            runs[name].append(run())
    reference = runs["mlx-lm batch"][0].tokens
    out = {}
    for name, rs in runs.items():
        out[name] = {
            "tokens_per_s": summarize([r.tokens_per_s for r in rs]),
            "vs_plain": summarize([r.tokens_per_s / p.tokens_per_s for r, p in zip(rs, runs["dyno plain"])]),
            "vs_mlx_lm": summarize([r.tokens_per_s / m.tokens_per_s for r, m in zip(rs, runs["mlx-lm batch"])]),
            "latency_s": statistics.median(x for r in rs for x in r.latency),
            "ttft_s": statistics.median(x for r in rs for x in r.ttft),
            "tokens": sum(len(t) for t in rs[0].tokens),
            "identical": all(r.tokens == reference for r in rs) if params.greedy else None,
            "depths": _merged([r.depths for r in rs]),
        }
    return out


def _merged(counts: List[Dict[int, int]]) -> Dict[int, int]:
    total: Dict[int, int] = {}
    for c in counts:
        for k, n in c.items():
            total[k] = total.get(k, 0) + n
    return dict(sorted(total.items()))
