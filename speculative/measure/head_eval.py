"""A head's acceptance on held-out text: each prompt continued through the engine's own `generate` at
each depth, greedy and sampled, folded by GenerationStats (the figures `dyno generate --json` reports).
The whole vocabulary is drafted from, so the head is measured, not a draft vocabulary.
`lm` is a loader.LoadedModel throughout, not imported: loader imports heads, not the reverse.
"""

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

from ..config import SamplingParams, SpecConfig
from ..engine import generate
from ..stats import GenerationStats


@dataclass
class Acceptance:
    """One setting's totals over the prompts: depth, temperature and the folded stats."""

    depth: int
    temperature: float
    stats: GenerationStats

    def as_dict(self) -> dict:
        s = self.stats
        return {"depth": self.depth, "temperature": self.temperature, "rounds": s.rounds,
                "tokens": len(s.tokens), "tokens_per_round": s.tokens_per_round,
                "acceptance_by_position": s.acceptance_by_position(),
                "accepted_per_position": s.accepted_per_position, "drafted_per_position": s.drafted_per_position}


def acceptance(lm, prompts: Sequence[Sequence[int]], depth: int, temperature: float = 0.0,
               max_tokens: int = 128, seed: int = 0) -> Acceptance:
    """Drafting `depth` tokens a round, each prompt continued for `max_tokens`; sampled runs are seeded
    (prompt i with seed + i), so a rerun gives the same figures."""
    total = GenerationStats(draft_depth=depth)
    spec = SpecConfig("mtp", depth, None)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                seed=None if temperature == 0 else seed + i)
        one = GenerationStats()
        for event in generate(lm, prompt, params, spec):
            one.add(event)
        total.merge(one)
        total.tokens += one.tokens
    return Acceptance(depth, temperature, total)


def sweep(lm, prompts: Sequence[Sequence[int]], depths: Sequence[int],
          temperatures: Sequence[float], max_tokens: int = 128, seed: int = 0) -> Iterator[Acceptance]:
    """acceptance() for every temperature and depth, one setting at a time as each finishes."""
    for temperature in temperatures:
        for depth in depths:
            yield acceptance(lm, prompts, depth, temperature, max_tokens, seed)


def table(results: List[Acceptance], label: Optional[str] = None) -> List[str]:
    """Lines of the report: per temperature, depth, tokens per round and acceptance by position."""
    lines = [label] if label else []
    for temperature in dict.fromkeys(r.temperature for r in results):
        lines.append("greedy" if temperature == 0 else f"temperature {temperature:g}")
        lines.append("  depth  tokens/round  acceptance by position")
        for r in (r for r in results if r.temperature == temperature):
            by_position = " ".join(f"{a:.3f}" for a in r.stats.acceptance_by_position())
            lines.append(f"  {r.depth:>5}  {r.stats.tokens_per_round or 1.0:>12.3f}  {by_position}")
    return lines
