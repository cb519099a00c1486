"""Benchmark logic: paired runs against plain mlx-lm, medians of ratios, and the cost model.

Protocol (docs: measuring.md): warm up once, then alternate the settings in cycles; each
Dyno run is compared with the plain mlx-lm run of the same cycle; report medians with min-max.
Decode speed = tokens after the first / time from first to last token (prefill excluded).
The cost model these runs are held against is in cost_model.py.
"""

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..config import SamplingParams, SpecConfig
from ..engine import generate
from ..loader import LoadedModel
from ..round.sampling import plain_sampler
from ..stats import GenerationStats
from .suites import SUITES, encode


@dataclass
class Run:
    """One generation's measurements; a Dyno run also carries its GenerationStats (the same fold the
    CLI line, /stats and /metrics use)."""

    tokens: List[int]
    decode_tps: float
    ttft_s: float
    stats: Optional[GenerationStats] = None


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


def run_dyno(lm: LoadedModel, prompt: Sequence[int], params: SamplingParams, spec: SpecConfig,
             drafter=None) -> Run:
    """Dyno through its public generator, folded by GenerationStats (`drafter`: generate's seam)."""
    stats = GenerationStats()
    for e in generate(lm, prompt, params, spec, drafter=drafter):
        stats.add(e)
    return Run(stats.tokens, stats.decode_tokens_per_s or 0.0, stats.done.prefill_s, stats)


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
    tokens_per_round: Optional[float] = None  # GenerationStats' figures over every pair
    acceptance_by_position: List[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0  # the counts behind both figures, to pool records (GenerationStats.from_counts)
    accepted_per_position: List[int] = field(default_factory=list)
    drafted_per_position: List[int] = field(default_factory=list)
    copies: str = "off"  # where drafts came from: the head alone, copies and the head, copies alone
    by_source: Dict[str, dict] = field(default_factory=dict)  # GenerationStats.by_source_json over every pair
    parked_rounds: int = 0  # rounds run at depth 0 while drafting (GenerationStats.parked_rounds)
    by_context: Dict[str, dict] = field(default_factory=dict)  # GenerationStats.by_context_json over every pair

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = summarize(self.ratios)
        d["decode_tps"] = summarize(self.tps)
        return d


def paired_benchmark(lm: LoadedModel, prompt: Sequence[int], params: SamplingParams, depths: Sequence[int],
                     pairs: int = 5, with_off: bool = True, auto_depth: Optional[int] = None,
                     draft_vocab: Optional[int] = None, drafter=None,
                     copies: Sequence[str] = ("off",)) -> Dict[str, object]:
    """Alternate plain mlx-lm with each Dyno setting, `pairs` cycles after one warm-up cycle.

    `auto_depth`: also run the depth `--draft-depth auto` resolved to, as its own setting "auto".
    `drafter`: every Dyno run's (engine.generate's seam; a tool's replayed drafts).
    `copies`: each depth with each of these draft sources (config.COPY_SOURCES): "off" is named
    mtp@k, "on" mtp@k+copies, "only" copies@k.
    """
    settings = [("off", SpecConfig("off"))] if with_off else []
    for k in depths:
        settings += [(setting_name(k, c), SpecConfig("mtp", k, draft_vocab, copies=c)) for c in copies]
    if auto_depth is not None:
        settings += [(setting_name(auto_depth, c, f"auto(={auto_depth})"),
                      SpecConfig("mtp", auto_depth, draft_vocab, copies=c)) for c in copies]
    results = {name: SettingResult(name, spec.draft_depth if spec.mode == "mtp" else None, [], [], [],
                                   True if params.greedy else None, copies=spec.copies) for name, spec in settings}
    base_tps, base_ttft = [], []
    run_mlx_lm(lm, prompt, params)  # warm-up: compile, allocate, fill caches
    for name, spec in settings:
        run_dyno(lm, prompt, params, spec, drafter=drafter)
    totals = {name: GenerationStats() for name, _ in settings}  # rounds and acceptance over all pairs
    for _ in range(pairs):
        base = run_mlx_lm(lm, prompt, params)
        base_tps.append(base.decode_tps)
        base_ttft.append(base.ttft_s)
        for name, spec in settings:
            run = run_dyno(lm, prompt, params, spec, drafter=drafter)
            r = results[name]
            r.tps.append(run.decode_tps)
            r.ttft.append(run.ttft_s)
            r.ratios.append(run.decode_tps / base.decode_tps if base.decode_tps else 0.0)
            if params.greedy and run.tokens != base.tokens:
                r.identical = False
            totals[name].merge(run.stats)
    for name, r in results.items():
        t = totals[name]
        r.drafted, r.accepted, r.rounds = t.draft_tokens, t.accepted_tokens, t.rounds
        r.accepted_per_position, r.drafted_per_position = t.accepted_per_position, t.drafted_per_position
        r.tokens_per_round, r.acceptance_by_position = t.tokens_per_round, t.acceptance_by_position()
        r.by_source = t.by_source_json()
        r.parked_rounds, r.by_context = t.parked_rounds, t.by_context_json()
    return {"plain": {"decode_tps": summarize(base_tps), "ttft": summarize(base_ttft)},
            "settings": {name: r.as_dict() for name, r in results.items()}}


def setting_name(depth: int, copies: str, head: Optional[str] = None) -> str:
    """A bench setting's name: `head` (default mtp@k) for the head alone, +copies beside it, copies@k alone."""
    head = head or f"mtp@{depth}"
    return {"off": head, "on": f"{head}+copies", "only": f"copies@{depth}"}[copies]


TUNE_DEPTHS = (1, 2, 3, 4)


def tune_prompts(tokenizer) -> List[List[int]]:
    """The prompts `dyno tune` pairs on: the code suite's first two."""
    return [encode(tokenizer, item) for item in SUITES["code"][:2]]


def tune_depths(lm: LoadedModel, prompts: Sequence[Sequence[int]], max_tokens: int, pairs: int,
                draft_vocab: Optional[int] = None, depths: Sequence[int] = TUNE_DEPTHS,
                drafter_for=None) -> Tuple[int, Dict[int, float], List[dict]]:
    """`dyno tune`'s choice: a paired benchmark of each depth on each prompt, the depth with the best
    median speedup over the prompts; (that depth, {depth: speedup}, each prompt's paired_benchmark).
    `drafter_for(i)`: the drafter for prompt i's Dyno runs (None: the engine's own)."""
    ratios = {k: [] for k in depths}
    results = []
    for i, prompt in enumerate(prompts):
        res = paired_benchmark(lm, prompt, SamplingParams(max_tokens=max_tokens), depths, pairs=pairs,
                               with_off=False, draft_vocab=draft_vocab,
                               drafter=drafter_for(i) if drafter_for is not None else None)
        results.append(res)
        for k in depths:
            ratios[k].append(res["settings"][f"mtp@{k}"]["ratio"]["median"])
    speedup = {k: statistics.median(v) for k, v in ratios.items()}
    return max(speedup, key=speedup.get), speedup, results
