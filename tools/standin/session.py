"""One long session: a prompt grown turn by turn, a fixed number of tokens decoded each turn, plain
decoding against drafting at each fixed depth, drafts replayed to acceptance that follows the context.

Every turn gets the cost model at its context (T1, Tv(k), Td with the attention caches padded to it,
cost_model.pad_attention): plain decodes 1/T1 tokens a second and depth k E(k)/(Tv(k) + k*Td), E(k)
= 1 + the profile's rates at that context summed to position k. Turns up to `measured_up_to` tokens
also run for real: the session's prompt is the last turn's, its answer and new tokens up to the
turn's length, reused through the prompt cache the caller gives (as a server would: only what is
new is prefilled);
a reference run drafting with the model's own head writes the tokens the replayed drafts follow,
then plain decoding (Dyno's "off" path, which is mlx-lm's generate_step) and each depth run in
alternation, each run's output checked equal to the reference. Past what fits in time on a slow
CPU only the model stands. Tools print; this returns a record.
"""

from typing import Callable, Dict, List, Optional, Sequence

from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.errors import DynoError
from speculative.loader import LoadedModel
from speculative.stats import GenerationStats
from speculative.measure.bench import summarize
from speculative.measure.cost_model import cost_timer
from speculative.measure.replay import Profile, rates_at, replayed_drafter
from .scale import draft_head, random_prompt


def doubling(first: int, last: int) -> List[int]:
    """Contexts from `first` doubling up to `last` (included): 1024, 2048, ..., 32768."""
    if not 0 < first <= last:
        raise ValueError(f"a session runs from a first context up to a last one, not {first} to {last}")
    out = [first]
    while out[-1] * 2 < last:
        out.append(out[-1] * 2)
    return out + [last] if out[-1] != last else out


def modeled(costs: Dict[str, object], rates: Sequence[float], depths: Sequence[int]) -> Dict[object, float]:
    """Tokens per second the cost model gives plain decoding ("plain") and each depth at these rates."""
    out = {"plain": 1 / costs["T1"]}
    for k in depths:
        out[k] = (1 + sum(rates[:k])) / (costs["Tv"][k] + k * costs["Td"])
    return out


def _run(lm, prompt, n, spec, cache, drafter=None) -> GenerationStats:
    stats = GenerationStats()
    for e in generate(lm, prompt, SamplingParams(max_tokens=n), spec, drafter=drafter, prefix_cache=cache):
        stats.add(e)
    return stats


def long_session(lm: LoadedModel, contexts: Sequence[int], depths: Sequence[int], profile: Profile,
                 max_tokens: int, measured_up_to: int, pairs: int = 1, reps: int = 5, seed: int = 0,
                 pad_prompt: int = 16, draft_vocab: Optional[int] = None, cache=None,
                 notify: Optional[Callable[[str], None]] = None) -> Dict[str, object]:
    """The record of one session through `contexts` (increasing), `max_tokens` decoded per turn;
    `draft_vocab` N: drafts over N rows (scale.draft_subset: a turn's reference tokens first), and
    the cost model's Td over N rows, as `--draft-vocab N` drafts. `cache`: the prompt cache the
    session's runs share (a PrefixCache, given by the caller: measure/ does not reach prompt_cache/),
    so each prefills only what is new; None: every run prefills its whole prompt."""
    say = notify or (lambda _m: None)
    prompt: List[int] = []
    turns = []
    for t, n in enumerate(contexts):
        rates = rates_at(profile, n)
        subset = {"sub": draft_head(lm, draft_vocab)} if draft_vocab else None  # (for timing: any N rows)
        costs = cost_timer(lm, random_prompt(pad_prompt, seed), depths, other_projections=subset, context=n)(reps, burst=1)
        if draft_vocab:
            costs["Td_whole_vocabulary"], costs["Td"] = costs["Td"], costs.pop("Td_other")["sub"]
        turn = {"context": n, "rates": list(rates), "cost_model": costs,
                "modeled_tps": {str(k): v for k, v in modeled(costs, rates, depths).items()}}
        if n <= measured_up_to:
            if len(prompt) >= n:
                raise DynoError(f"turn {t + 1} of {n} tokens: the session already holds {len(prompt)} (each turn "
                                "adds its answer; leave more room between contexts)")
            prompt = prompt + random_prompt(n - len(prompt), seed + t + 1)
            reference = _run(lm, prompt, max_tokens + max(depths), SpecConfig("mtp", max(depths)), cache).tokens
            head = draft_head(lm, draft_vocab, reference) if draft_vocab else None
            plain, runs = [], {k: [] for k in depths}
            for i in range(pairs):
                plain.append(_run(lm, prompt, max_tokens, SpecConfig("off"), cache))
                for k in depths:
                    # A seed per turn and pair: each samples rounds of its own.
                    drafter = replayed_drafter(lm, reference, profile, seed + 1000 * (t + 1) + i, head)
                    run = _run(lm, prompt, max_tokens, SpecConfig("mtp", k), cache, drafter)
                    if run.tokens != reference[:max_tokens]:
                        raise AssertionError(f"context {n}, depth {k}: replayed drafting changed the greedy output")
                    runs[k].append(run)
            if any(r.tokens != reference[:max_tokens] for r in plain):
                raise AssertionError(f"context {n}: plain decoding and drafting disagree")
            turn["measured"] = {"plain": summarize([r.decode_tokens_per_s for r in plain]), "depths": {},
                                "tokens": len(plain[0].tokens)}  # (fewer than max_tokens: EOS came first)
            for k in depths:
                total = GenerationStats()
                for r in runs[k]:
                    total.merge(r)
                turn["measured"]["depths"][str(k)] = {
                    "decode_tps": summarize([r.decode_tokens_per_s for r in runs[k]]),
                    "ratio": summarize([r.decode_tokens_per_s / p.decode_tokens_per_s for r, p in zip(runs[k], plain)]),
                    "acceptance_by_position": total.acceptance_by_position(),
                    "tokens_per_round": total.tokens_per_round, "rounds": total.rounds}
            prompt = prompt + reference[:max_tokens]  # the next turn follows this answer
            say(f"context {n}: plain {turn['measured']['plain']['median']:.1f} tok/s, " + ", ".join(
                f"depth {k} {d['decode_tps']['median']:.1f}" for k, d in turn["measured"]["depths"].items()))
        else:
            say(f"context {n} (cost model): plain {turn['modeled_tps']['plain']:.1f} tok/s, " + ", ".join(
                f"depth {k} {turn['modeled_tps'][str(k)]:.1f}" for k in depths))
        turns.append(turn)
    return {"contexts": list(contexts), "depths": list(depths), "max_tokens": max_tokens, "draft_vocab": draft_vocab,
            "measured_up_to": measured_up_to, "pairs": pairs, "reps": reps, "turns": turns,
            "session": session_totals(turns, depths, max_tokens)}


def tps(turn: Dict[str, object], key: str) -> float:
    """A turn's tokens per second for "plain" or a depth: measured (median) where it ran, else modeled."""
    m = turn.get("measured")
    if m is None:
        return turn["modeled_tps"][key]
    return (m["plain"] if key == "plain" else m["depths"][key]["decode_tps"])["median"]


def session_totals(turns, depths: Sequence[int], max_tokens: int) -> Dict[str, object]:
    """The whole session's decode time for plain and each fixed depth, and for the best choice of
    each turn (plain included), as speedups over plain."""
    keys = ["plain"] + [str(k) for k in depths]
    seconds = {key: sum(max_tokens / tps(t, key) for t in turns) for key in keys}
    best_each = sum(max_tokens / max(tps(t, key) for key in keys) for t in turns)
    return {"decode_s": seconds, "speedup": {key: seconds["plain"] / s for key, s in seconds.items()},
            "best_each_turn_speedup": seconds["plain"] / best_each}
