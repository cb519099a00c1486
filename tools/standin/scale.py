"""Speed at real scale: one real-shaped model, replayed acceptance, paired against plain mlx-lm.

At one context length: a plain greedy reference run (which the replayed drafts follow), the cost
model (T1, Tv(k), Td over the whole vocabulary and over a draft vocabulary), then pairs of plain
mlx-lm and Dyno at each depth, alternating, with the bound and the engine efficiency. Every Dyno
run must reproduce the reference tokens (asserted). Tools print; this returns a record.

A random model cannot rank a draft vocabulary (it spreads its mass evenly), so the subset is made
here (draft_subset): the reference run's tokens, which a ranking by the model's own outputs would
put first, then the first ids or a seeded draw. With `draft_vocab` N the replayed drafts run the
head over those N rows, as `--draft-vocab N` does; the profile then assumes the subset covers what
the trunk writes, as the real ranking did on the bundled model (docs/performance.md).
"""

import random
from typing import Dict, List, Optional, Sequence

import numpy as np

from speculative.config import SamplingParams, SpecConfig
from speculative.draft_vocab.head import AUTO_MIN_SHARE, AUTO_STEP, DraftLMHead, lm_head_module, ranked_ids
from speculative.loader import LoadedModel
from speculative.stats import GenerationStats
from speculative.measure.bench import TUNE_DEPTHS, run_dyno, run_mlx_lm, summarize, tune_depths, tune_prompts
from speculative.measure.cost_model import cost_timer, speedup_bound
from speculative.measure.replay import replayed_drafter
from speculative.measure.tuning import best_by_cost


def draft_vocab_floor(vocab: int) -> int:
    """auto's smallest draft vocabulary (draft_vocab.head: 1/8 of the rows, in steps of 256)."""
    return -(-int(vocab * AUTO_MIN_SHARE) // AUTO_STEP) * AUTO_STEP


def random_prompt(length: int, seed: int = 0, vocab: int = 256) -> List[int]:
    """`length` seeded token ids among the tokenizer's byte tokens: context for a random model."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def draft_subset(tokenizer, vocab: int, size: int, first: Sequence[int] = (), ids: str = "first",
                 seed: int = 0) -> List[int]:
    """`size` sorted draft ids for a model with no ranking: the special tokens, `first` (the reference's
    tokens), then the lowest ids (`ids` "first") or a seeded draw ("seeded")."""
    rest = range(vocab) if ids == "first" else np.random.default_rng(seed).permutation(vocab).tolist()
    return ranked_ids(tokenizer, vocab, size, order=[*dict.fromkeys(first), *rest])


def draft_head(lm: LoadedModel, size: int, first: Sequence[int] = (), ids: str = "first",
               seed: int = 0) -> DraftLMHead:
    """The trunk's lm_head over draft_subset's `size` ids: the draft step a random model's runs take."""
    vocab = lm.target.args.vocab_size
    return DraftLMHead(lm_head_module(lm.target), draft_subset(lm.tokenizer, vocab, size, first, ids, seed), vocab)


def subset_label(ids: str, seed: int = 0) -> str:
    """How draft_subset chose its ids, for the record."""
    rest = "the lowest ids" if ids == "first" else f"a seeded draw (seed {seed})"
    return f"special tokens, the reference run's tokens, then {rest}"


def measure_context(lm: LoadedModel, prompt: Sequence[int], depths: Sequence[int], profile: Sequence[float],
                    max_tokens: int, pairs: int, reps: int, seed: int = 0, paired: bool = True,
                    padded_to: Optional[int] = None, notify=None, draft_vocab: Optional[int] = None,
                    draft_ids: str = "first", pair_reps: int = 3) -> Dict[str, object]:
    """The record for one context: reference, cost model, and (when `paired`) the paired runs.

    `padded_to` (cost model only, not paired): the attention caches grown to that many rows after
    `prompt` (cost_model.pad_attention), a long context without its prefill. `draft_vocab` N: the
    runs draft over N rows (draft_subset, `draft_ids` its way of filling up), and the cost model's
    subset is that one; None: over the whole vocabulary, the subset timed being auto's floor.

    After each pair the model calls are timed again (`pair_reps` rounds): each pair's efficiency is
    its speedup against the bound of the calls timed beside it, so the machine's drift over the
    minutes of a run lands on both sides of that ratio alike ("paired" in the record).
    """
    say = notify or (lambda _m: None)
    params = SamplingParams(max_tokens=max_tokens)
    record = {"context": padded_to or len(prompt), "padded": bool(padded_to), "depths": {}}
    reference = None
    if paired:  # the tokens the replayed drafts follow; its prefill is mlx-lm's
        reference = run_mlx_lm(lm, prompt, SamplingParams(max_tokens=max_tokens + max(depths)))
        record["reference_prefill_s"] = reference.ttft_s
        say(f"reference: {len(reference.tokens)} tokens, prefill {reference.ttft_s:.2f}s")
    vocab = lm.target.args.vocab_size
    n = draft_vocab or draft_vocab_floor(vocab)
    first = reference.tokens if reference is not None and draft_vocab else ()
    subset = draft_head(lm, n, first, draft_ids, seed)
    record["draft_vocab"] = ({"tokens": n, "ids": subset_label(draft_ids, seed)} if draft_vocab else
                             {"tokens": None, "ids": "the whole vocabulary"})
    timer = cost_timer(lm, prompt, depths, other_projections={n: subset}, context=padded_to)

    def time_calls(reps, warmup=2):
        costs = timer(reps, burst=1, warmup=warmup)
        costs["Td_draft_vocab"], costs["draft_vocab_tokens"] = costs.pop("Td_other")[n], n
        return costs
    costs = time_calls(reps)
    record["cost_model"] = costs
    # The depth `--draft-depth auto` estimates without `dyno tune` (tuning.best_by_cost), for this
    # acceptance and the projection the runs draft with.
    drafting = {**costs, "Td": costs["Td_draft_vocab"]} if draft_vocab else costs
    record["auto_estimate"] = best_by_cost(drafting, profile)
    say(f"cost model at {record['context']}: T1 {costs['T1'] * 1e3:.0f}ms Td {costs['Td'] * 1e3:.0f}ms")
    if not paired:
        for k in depths:
            record["depths"][k] = _bounds(costs, k, 1 + sum(profile[:k]))
        return record
    head = subset if draft_vocab else None  # the drafts' projection: the subset's rows, or the lm_head
    drafter = replayed_drafter(lm, reference.tokens, profile, seed, head)
    for k in depths:  # warm-up: allocation and the first pass at each width
        run_dyno(lm, prompt, SamplingParams(max_tokens=4), SpecConfig("mtp", k, None), drafter=drafter)
    plain, runs, beside = [], {k: [] for k in depths}, []
    for i in range(pairs):
        plain.append(run_mlx_lm(lm, prompt, params))
        for k in depths:
            # Each run its own seed: the pairs sample different rounds, as different prompts would.
            run = run_dyno(lm, prompt, params, SpecConfig("mtp", k, None),
                           drafter=replayed_drafter(lm, reference.tokens, profile, seed + i, head))
            if run.tokens != reference.tokens[:max_tokens]:
                raise AssertionError(f"depth {k}: replayed drafting changed the greedy output")
            runs[k].append(run)
            say(f"pair {i + 1}: depth {k} {run.decode_tps / plain[-1].decode_tps:.2f}x")
        if pair_reps:
            beside.append(time_calls(pair_reps, warmup=0))
    record["plain"] = {"decode_tps": summarize([r.decode_tps for r in plain]),
                       "prefill_s": summarize([r.ttft_s for r in plain])}
    # Plain mlx-lm's own step against T1: the bound assumes they are equal.
    record["plain"]["step_over_t1"] = 1 / record["plain"]["decode_tps"]["median"] / costs["T1"]
    td = "Td_draft_vocab" if draft_vocab else "Td"  # the draft step the runs took
    for k in depths:
        total = GenerationStats()
        for r in runs[k]:
            total.merge(r.stats)
        ratios = [r.decode_tps / p.decode_tps for r, p in zip(runs[k], plain)]
        entry = _bounds(costs, k, total.tokens_per_round)
        entry.update(ratio=summarize(ratios), ratios=ratios, decode_tps=summarize([r.decode_tps for r in runs[k]]),
                     prefill_s=summarize([r.ttft_s for r in runs[k]]), identical=True,
                     acceptance_by_position=total.acceptance_by_position(), rounds=total.rounds)
        # Against the bound of the projection the runs drafted with.
        entry["efficiency"] = entry["ratio"]["median"] / entry["bound_draft_vocab" if draft_vocab else "bound"]
        # Where the time goes: a round as decoded (tokens per round / decode rate) against the model
        # calls the bound counts, Tv(k) + k*Td, timed apart from the runs.
        entry["round_s"] = total.tokens_per_round / entry["decode_tps"]["median"]
        entry["model_calls_s"] = costs["Tv"][k] + k * costs[td]
        if beside:
            entry["paired"] = _paired(runs[k], plain, beside, k, td)
        record["depths"][k] = entry
    if beside:
        record["plain"]["paired_step_over_t1"] = summarize([1 / p.decode_tps / c["T1"] for p, c in zip(plain, beside)])
        record["pair_reps"], record["cost_model_beside_pairs"] = pair_reps, beside
    return record


def _paired(runs, plain, beside, k: int, td: str) -> Dict[str, object]:
    """Each pair's run against the model calls timed right after it: its efficiency (its speedup over
    the bound of those calls at its own tokens per round) and its round over Tv(k) + k*Td."""
    pairs = []
    for run, p, c in zip(runs, plain, beside):
        e, ratio = run.stats.tokens_per_round, run.decode_tps / p.decode_tps
        pairs.append({"ratio": ratio, "tokens_per_round": e,
                      "efficiency": ratio / speedup_bound(e, c["T1"], c["Tv"][k], c[td], k),
                      "round_over_calls": e / run.decode_tps / (c["Tv"][k] + k * c[td])})
    return {"efficiency": summarize([q["efficiency"] for q in pairs]),
            "round_over_calls": summarize([q["round_over_calls"] for q in pairs]), "pairs": pairs}


def tune_replayed(lm: LoadedModel, profile: Sequence[float], max_tokens: int, pairs: int,
                  depths: Sequence[int] = TUNE_DEPTHS, draft_vocab: Optional[int] = None,
                  draft_ids: str = "first", seed: int = 0) -> Dict[str, object]:
    """`dyno tune`'s procedure (bench.tune_depths: its prompts, the first two of the code suite, paired
    at each depth) on a random model, each prompt's drafts replayed to `profile` against its plain greedy
    reference, over `draft_vocab` rows as measure_context drafts; the depth it picks and its speedups."""
    prompts = tune_prompts(lm.tokenizer)
    references = [run_mlx_lm(lm, p, SamplingParams(max_tokens=max_tokens + max(depths))).tokens for p in prompts]
    head = (draft_head(lm, draft_vocab, [t for r in references for t in r], draft_ids, seed)
            if draft_vocab else None)
    best, speedup, results = tune_depths(lm, prompts, max_tokens, pairs, None, depths,
                                         drafter_for=lambda i: replayed_drafter(lm, references[i], profile, seed, head))
    if not all(s["identical"] for r in results for s in r["settings"].values()):
        raise AssertionError("replayed drafting changed the greedy output")
    return {"prompts": "the code suite's first two", "max_tokens": max_tokens, "pairs": pairs,
            "depths": list(depths), "pick": best, "speedup": speedup,
            "tokens_per_round": {k: [r["settings"][f"mtp@{k}"]["tokens_per_round"] for r in results] for k in depths}}


def _bounds(costs: dict, k: int, tokens_per_round: float) -> dict:
    """The cost model's bound at depth k, drafting over the whole vocabulary and over the subset."""
    t1, tv = costs["T1"], costs["Tv"][k]
    return {"tokens_per_round": tokens_per_round, "tv_over_t1": tv / t1,
            "bound": speedup_bound(tokens_per_round, t1, tv, costs["Td"], k),
            "bound_draft_vocab": speedup_bound(tokens_per_round, t1, tv, costs["Td_draft_vocab"], k)}
