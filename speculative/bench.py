"""Benchmark logic: paired runs against plain mlx-lm, medians of ratios, and the cost model.

Protocol (docs: measuring.md): warm up once, then alternate the settings in cycles; each
Dyno run is compared with the plain mlx-lm run of the same cycle; report medians with min-max.
Decode speed = tokens after the first / time from first to last token (prefill excluded).
"""

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step

from .config import SamplingParams, SpecConfig
from .draft_vocab import draft_lm_head
from .engine import generate
from .loader import LoadedModel
from .sampling import plain_sampler
from .stats import GenerationStats


@dataclass
class Run:
    """One generation's measurements."""

    tokens: List[int]
    decode_tps: float
    ttft_s: float
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: List[int] = field(default_factory=list)

    @property
    def tokens_per_round(self) -> Optional[float]:
        return len(self.tokens) / self.rounds if self.rounds else None


def _tps(n: int, first: float, last: float) -> float:
    return (n - 1) / (last - first) if n > 1 and last > first else 0.0


def run_mlx_lm(lm: LoadedModel, prompt: Sequence[int], params: SamplingParams) -> Run:
    """The baseline: mlx-lm's own generate_step with mlx-lm's sampler, stopping at EOS."""
    if params.seed is not None:
        mx.random.seed(params.seed)
    sampler = plain_sampler(params, lm.vocab_size)
    start = time.perf_counter()
    tokens, first, last = [], None, None
    for tok, _ in generate_step(mx.array(list(prompt)), lm.model, max_tokens=params.max_tokens, sampler=sampler):
        last = time.perf_counter()
        first = first or last
        tokens.append(int(tok))
        if tokens[-1] in lm.eos_token_ids:
            break
    return Run(tokens, _tps(len(tokens), first, last), (first or start) - start)


def run_dyno(lm: LoadedModel, prompt: Sequence[int], params: SamplingParams, spec: SpecConfig) -> Run:
    """Dyno through its public generator, folded by GenerationStats."""
    stats = GenerationStats()
    for e in generate(lm, prompt, params, spec):
        stats.add(e)
    done = stats.done
    return Run(stats.tokens, stats.decode_tokens_per_s or 0.0, done.prefill_s, stats.rounds,
               stats.draft_tokens, stats.accepted_tokens, stats.accepted_per_position)


def summarize(values: Sequence[float]) -> Dict[str, float]:
    """Median with min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@dataclass
class SettingResult:
    name: str  # "off" or "mtp@k"
    depth: Optional[int]
    ratios: List[float]  # per pair: this setting's decode tok/s / plain mlx-lm's
    tps: List[float]
    ttft: List[float]
    identical: Optional[bool]  # greedy only: same tokens as plain mlx-lm in every pair
    tokens_per_round: Optional[float] = None
    acceptance_by_position: List[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = summarize(self.ratios)
        d["decode_tps"] = summarize(self.tps)
        return d


def paired_benchmark(lm: LoadedModel, prompt: Sequence[int], params: SamplingParams, depths: Sequence[int],
                     pairs: int = 5, with_off: bool = True, auto_depth: Optional[int] = None,
                     draft_vocab: Optional[int] = None) -> Dict[str, object]:
    """Alternate plain mlx-lm with each Dyno setting, `pairs` cycles after one warm-up cycle.

    `auto_depth`: also run the depth `--draft-depth auto` resolved to, as its own setting "auto".
    """
    settings = ([("off", SpecConfig("off"))] if with_off else []) + [
        (f"mtp@{k}", SpecConfig("mtp", k, draft_vocab)) for k in depths]
    if auto_depth is not None:
        settings.append((f"auto(={auto_depth})", SpecConfig("mtp", auto_depth, draft_vocab)))
    results = {name: SettingResult(name, spec.draft_depth if spec.mode == "mtp" else None, [], [], [],
                                   True if params.greedy else None) for name, spec in settings}
    base_tps, base_ttft = [], []
    run_mlx_lm(lm, prompt, params)  # warm-up: compile, allocate, fill caches
    for name, spec in settings:
        run_dyno(lm, prompt, params, spec)
    rounds = {name: [0, 0, []] for name, _ in settings}
    for _ in range(pairs):
        base = run_mlx_lm(lm, prompt, params)
        base_tps.append(base.decode_tps)
        base_ttft.append(base.ttft_s)
        for name, spec in settings:
            run = run_dyno(lm, prompt, params, spec)
            r = results[name]
            r.tps.append(run.decode_tps)
            r.ttft.append(run.ttft_s)
            r.ratios.append(run.decode_tps / base.decode_tps if base.decode_tps else 0.0)
            if params.greedy and run.tokens != base.tokens:
                r.identical = False
            acc = rounds[name]
            acc[0] += run.rounds
            acc[1] += len(run.tokens)
            r.drafted += run.drafted
            r.accepted += run.accepted
            per_pos = acc[2]
            per_pos.extend([0] * (len(run.accepted_per_position) - len(per_pos)))
            for i, c in enumerate(run.accepted_per_position):
                per_pos[i] += c
    for name, r in results.items():
        n_rounds, n_tokens, per_pos = rounds[name]
        if n_rounds:
            r.tokens_per_round = n_tokens / n_rounds
            r.acceptance_by_position = [c / n_rounds for c in per_pos]
    return {"plain": {"decode_tps": summarize(base_tps), "ttft": summarize(base_ttft)},
            "settings": {name: r.as_dict() for name, r in results.items()}}


# ---- the cost model: T1, Tv(k), Td on this model and machine ---------------------------------

def _snapshot(cache):
    """References to every cache's arrays (MLX arrays are immutable, so this is a copy)."""
    return [(c.offset,) if hasattr(c, "offset") else (c[0], c[1]) for c in cache]


def _restore(cache, snap):
    for c, s in zip(cache, snap):
        if hasattr(c, "offset"):
            c.trim(c.offset - s[0])
        else:
            c[0], c[1] = s


def _queued(build, n: int) -> float:
    """Seconds for n calls of `build` queued back to back, the last one waited for."""
    start = time.perf_counter()
    out = None
    for _ in range(n):
        out = build()
        mx.async_eval(out)
    mx.eval(out)
    return time.perf_counter() - start


def _per_call(build, burst: int) -> float:
    """Seconds per call of `build` run back to back the way a decoding loop runs it.

    mlx-lm's generate_step builds step n+1 while step n computes (async_eval); timing each call
    with a blocking eval would charge the graph building to the model and inflate T1 (by about
    8% on this machine). A run of n queued calls still exposes its first build and last wait,
    so the difference of runs of 2n and n calls is taken: the edges cancel.
    """
    return (_queued(build, 2 * burst) - _queued(build, burst)) / burst


def _interleaved(builds: Dict[object, object], reps: int, burst: int = 2) -> Dict[object, float]:
    """Median seconds per call of each graph builder, timed round-robin.

    This machine's speed drifts by tens of percent within seconds; timing one function's reps
    in a block and the next one's later would put that drift into their ratios (the bound).
    """
    for _ in range(2):  # warm-up: graph compile and allocation
        for build in builds.values():
            _queued(build, 1)
    samples = {name: [] for name in builds}
    for _ in range(reps):
        for name, build in builds.items():
            samples[name].append(_per_call(build, burst))
    return {name: statistics.median(v) for name, v in samples.items()}


def cost_model(lm: LoadedModel, prompt: Sequence[int], depths: Sequence[int], reps: int = 15,
               burst: int = 2, draft_vocab: Optional[int] = None) -> Dict[str, object]:
    """Seconds per 1-token trunk step (T1), per k+1-token verify (Tv(k)) and per head step (Td).

    Each builder queues one call's graph and rewinds the caches, so back-to-back calls all
    see the same context.
    """
    target, head = lm.target, lm.head
    draft_projection = draft_lm_head(lm, draft_vocab)  # what the draft step multiplies by
    trunk = target.make_cache()
    tokens = mx.array(list(prompt))[None]
    hidden = target.hidden(tokens, trunk)
    head_cache = head.make_cache()
    head(target.embed(tokens), hidden, head_cache)
    mx.eval([c.state for c in trunk + head_cache])
    snap = _snapshot(trunk)
    last = tokens[:, -1:]

    def step():
        out = mx.argmax(target.lm_head(target.hidden(last, trunk)), axis=-1)
        _restore(trunk, snap)
        return out

    def verify(k):
        def build():
            logits, hid, tapes = target.verify(mx.repeat(last, k + 1, axis=1), trunk)
            _restore(trunk, snap)
            return [mx.argmax(logits, axis=-1)] + [t.states[-1] if t.states else t.conv_input for t in tapes]
        return build

    g = hidden[:, -1:]
    offset = head_cache[0].offset

    def draft():
        out = head(target.embed(last), g, head_cache)
        head_cache[0].trim(head_cache[0].offset - offset)
        return mx.argmax(draft_projection(out[:, -1]), axis=-1)

    t = _interleaved({"T1": step, "Td": draft, **{k: verify(k) for k in depths}}, reps, burst)
    return {"T1": t["T1"], "Tv": {k: t[k] for k in depths}, "Td": t["Td"]}


def speedup_bound(tokens_per_round: float, t1: float, tv: float, td: float, k: int) -> float:
    """E / (Tv(k)/T1 + k*Td/T1): what the model calls alone allow."""
    return tokens_per_round / (tv / t1 + k * td / t1)
