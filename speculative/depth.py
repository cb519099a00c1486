"""How deep a model drafts, decided once when it is loaded (load_model): a depth for a request
decoded alone and the policy that picks each batched round's depth.

`--draft-depth N` pins both. "auto": the depth `dyno tune` stored for this model, machine and
draft vocabulary, else a cost-model estimate of a few seconds (stored too); batched rounds choose
each round's depth by the costs `dyno tune` stored, else a measurement of batched rounds (stored).
The measuring itself is measure/'s; this module only decides from it.
"""

from typing import Callable, List, Optional, Tuple

from .measure.batch_cost import measure_batch_costs
from .measure.cost_model import cost_model
from .measure.tuning import ESTIMATE_PROMPT, best_by_cost, measured_acceptance, prior_rates, store, stored
from .round.depth_policy import BatchCosts, DepthPolicy

ESTIMATED_DEPTHS = range(1, 5)  # the single-request estimate's candidates: a chained head rarely pays past 4


def prior_acceptance(lm, draft_vocab: Optional[int] = None) -> List[float]:
    """Acceptance by position before any round: the tuned or estimated one stored, else the prior."""
    found = stored(lm, draft_vocab) or {}
    return list(found.get("acceptance") or prior_rates())


def single_depth(lm, requested, draft_vocab: Optional[int] = None, drafter=None) -> int:
    """An explicit depth as given; "auto": the stored one, else a cost-model estimate (stored too),
    for drafts scored over `draft_vocab` tokens (draft_vocab.resolve's N; None: the whole vocabulary).
    `drafter` goes to the estimate's acceptance run (engine.generate's seam)."""
    if requested != "auto":
        return int(requested)
    if lm.head is None:
        return 1
    found = stored(lm, draft_vocab)
    if found:
        return int(found["depth"])
    # Open-ended code, so that a short greedy run does not stop at once (code is where MTP heads
    # are judged, and what `dyno bench`'s default suite measures).
    prompt = lm.tokenizer.encode(ESTIMATE_PROMPT) or [0]
    costs = cost_model(lm, prompt, list(ESTIMATED_DEPTHS), reps=9, burst=1, draft_vocab=draft_vocab)  # ~2 s
    acceptance = measured_acceptance(lm, prompt, max(ESTIMATED_DEPTHS), draft_vocab=draft_vocab,
                                     drafter=drafter) or prior_rates()
    depth = best_by_cost(costs, acceptance)
    store(lm, depth, {"source": "estimate", "cost_model": costs, "acceptance": acceptance}, draft_vocab)
    return depth


def batched_policy(lm, requested, draft_vocab: Optional[int] = None,
                   notify: Callable[[str], None] = lambda message: None) -> DepthPolicy:
    """`--draft-depth N`: a policy pinned at N; "auto": the costs `dyno tune` stored, else a quick
    measurement (seconds; stored with the entry, so the next start reads it), announced by `notify`."""
    if requested != "auto":
        return DepthPolicy(None, [], pinned=int(requested))
    found = stored(lm, draft_vocab)
    if not found:  # the single-request estimate first: its acceptance is this policy's prior
        single_depth(lm, "auto", draft_vocab)
        found = stored(lm, draft_vocab) or {}
    prior = prior_acceptance(lm, draft_vocab)
    single = int(found.get("depth", 1))
    if found.get("batch_costs"):
        return DepthPolicy(BatchCosts.from_json(found["batch_costs"]), prior, single=single, per_row=True)
    notify("dyno: timing batched rounds of this model on this machine, once (stored for later starts; "
           "--decode-concurrency 1 serves without them)")
    prompt = lm.tokenizer.encode(ESTIMATE_PROMPT) or [0]
    costs = measure_batch_costs(lm, prompt, reps=3, draft_vocab=draft_vocab)
    details = {k: v for k, v in found.items() if k not in ("depth", "draft_vocab")}
    store(lm, single, {**details, "batch_costs": costs.as_json()}, draft_vocab)
    return DepthPolicy(costs, prior, single=single, per_row=True)


def decide(lm, requested, draft_vocab: Optional[int], default: int, batched: bool = False, split: bool = False,
           notify: Callable[[str], None] = lambda message: None) -> Tuple[int, DepthPolicy]:
    """(the depth of a request decoded alone, the policy of batched rounds) for `requested` (N or "auto").

    Without a head: `default`, pinned. `batched` False: the policy is pinned at the single depth (no
    batched round will ask it). `split` across processes: the depth given, else the stored one, else
    `default`, never an estimate (its timing runs would be collectives on one rank alone)."""
    if lm.head is None:
        return default, DepthPolicy(None, [], pinned=default)
    if split:
        depth = int(requested) if requested != "auto" else int((stored(lm) or {}).get("depth", default))
        return depth, DepthPolicy(None, [], pinned=depth)
    depth = single_depth(lm, requested, draft_vocab)
    if batched:
        return depth, batched_policy(lm, requested, draft_vocab, notify)
    # Alone, "auto" drafts at most the chosen depth, each round as deep as the row's own acceptance pays.
    auto = requested == "auto"
    return depth, DepthPolicy(None, prior_acceptance(lm, draft_vocab) if auto else [], pinned=depth, per_row=auto)
