"""Replayed acceptance: drafts scripted to a given acceptance profile, for benchmarks of random models.

A random-weight model's head never drafts the trunk's token, so its rounds would all be rejections
and say nothing of what a trained head earns. Here the real head still runs every draft step (its
cost is real); each draft is then replaced by the token plain greedy decoding wrote at that
position (known from a reference run) or by a wrong one, so that draft position j is accepted
with probability profile[j]. Verify, acceptance, rollback and the head rows run for real, and the
output is still the plain greedy text. Used only by the benchmarks: no server or CLI path makes one.
It is a drafter (round/drafter.py), so it runs at any width, each row against its own reference.

Over a draft vocabulary (`draft_head`, a DraftLMHead) the head projects onto the subset's rows only,
as `--draft-vocab` does, and every scripted draft is one of the subset's ids: a reference token
outside it cannot be drafted, so its position counts as a miss.
"""

import bisect
import random
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ..batched import BatchSpeculator
from ..errors import DynoError
from ..round.drafter import Drafts, HeadDrafter
from .tuning import PRIOR_DECAY, PRIOR_FIRST

# Acceptance by draft position (GenerationStats' acceptance_by_position at depth 3).
PROFILES: Dict[str, Tuple[float, ...]] = {
    # Qwen3.8-27B's head on code, greedy, published (tuning.py's prior cites it too).
    "27b-code": (0.93, 0.86, 0.75),
    # No published chat profile was at hand: Dyno's own prior (0.8, 0.6, 0.45).
    "chat": tuple(round(PRIOR_FIRST * PRIOR_DECAY**i, 4) for i in range(3)),
    # The bundled dyno-tiny on the code suite, greedy, depth 3 (docs/performance.md).
    "dyno-tiny": (0.78, 0.57, 0.43),
}


def parse_profile(text: str) -> Tuple[float, ...]:
    """A profile by name (PROFILES) or as comma-separated rates, non-increasing, each in [0, 1]."""
    if text in PROFILES:
        return PROFILES[text]
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise DynoError(f"acceptance must be one of {', '.join(PROFILES)} or rates like 0.93,0.86,0.75: {text!r}") from None
    if not rates or any(not 0 <= r <= 1 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
        raise DynoError(f"acceptance rates must be non-increasing and within [0, 1]: {text!r}")
    return rates


class Script:
    """Scripted drafts against one reference: each round, position j right with probability profile[j]
    (one uniform per round, seeded by the round's start: `right` leading drafts are the reference's,
    so P(position j accepted) = P(right >= j) = profile[j - 1] for a non-increasing profile). Over a draft vocabulary (`subset`,
    sorted ids) a reference token outside it cannot be drafted: its position is a miss."""

    def __init__(self, reference: Sequence[int], profile: Sequence[float], vocab: int, subset=None,
                 seed: Union[int, str] = 0):
        self.reference, self.profile, self.vocab = list(reference), list(profile), vocab
        self.subset, self.seed = subset, seed
        self.in_subset = set(subset) if subset is not None else None

    def _wrong(self, true: Optional[int]) -> int:
        """A token other than `true`: the next id, or the subset's next id over a draft vocabulary."""
        if self.subset is None:
            return ((true or 0) + 1) % self.vocab
        return self.subset[bisect.bisect_right(self.subset, -1 if true is None else true) % len(self.subset)]

    def drafts(self, start: int, k: int) -> List[int]:
        """k drafts for reference[start], reference[start + 1], ...: the same for a position however
        often it is drafted (a batch drafts again what a join or a leave took back), so a row's
        rounds do not depend on the rows beside it, and every run with this seed has the same."""
        u = random.Random(f"{self.seed}/{start}").random()
        right = sum(u < a for a in self.profile[:k])
        out = []
        for j in range(k):
            i = start + j
            true = self.reference[i] if i < len(self.reference) else None
            draftable = true is not None and (self.subset is None or true in self.in_subset)
            out.append(true if j < right and draftable else self._wrong(true))
        return out


def scripted(computed: mx.array, drafts: List[List[int]]) -> mx.array:
    """`drafts` in place of the head's `computed` ones; where() reads the computed, so evaluating the
    scripted drafts still runs the head."""
    keep = mx.ones(computed.shape, dtype=mx.bool_)
    return mx.where(keep, mx.array(drafts, dtype=computed.dtype).reshape(computed.shape), computed)


class ReplayedDrafter(HeadDrafter):
    """The head's drafts, computed, then swapped for each row's script: row `row_id` against
    `references[row_id]` (that row's plain greedy tokens) with its own seed, so a row's rounds do not
    depend on the rows beside it. Greedy rows only."""

    def __init__(self, references: Dict[Hashable, Sequence[int]], profile: Sequence[float], vocab: int,
                 seed: int = 0, draft_head=None, row_seeds: bool = True):
        """`draft_head`: a DraftLMHead the draft step projects onto, its ids the only draftable ones
        (None: the round's own projection); `row_seeds`: each row's script seeded by its id too."""
        super().__init__(draft_head)
        subset = None if draft_head is None else draft_head.ids.tolist()
        self.scripts = {i: Script(ref, profile, vocab, subset, f"{seed}/{i}" if row_seeds else seed)
                        for i, ref in references.items()}

    def refuses(self, params) -> Optional[str]:
        return None if params.greedy else "replayed acceptance scripts greedy drafts only"

    def propose(self, rounds, budgets: Sequence[int]) -> Drafts:
        drafts = super().propose(rounds, budgets)
        k = drafts.tokens.shape[1]
        # (a generation's one row, whatever its id, by the script under None)
        rows = [self.scripts[r.id if r.id in self.scripts else None].drafts(len(r.generated), k) for r in rounds.rows]
        return drafts._replace(tokens=scripted(drafts.tokens, rows))


def replayed_drafter(lm, reference: Sequence[int], profile: Sequence[float], seed: int = 0,
                     draft_head=None) -> ReplayedDrafter:
    """engine.generate's `drafter`: replayed drafts against `reference`, the plain greedy tokens of
    the same prompt (as many as the run generates, plus its depth), over `draft_head`'s rows when given."""
    return ReplayedDrafter({None: reference}, profile, lm.vocab_size, seed, draft_head, row_seeds=False)


class ReplayedBatch(BatchSpeculator):
    """A BatchSpeculator drafting by a ReplayedDrafter, each row against `references[row_id]` and its own
    seed; the draft step over `draft_head`'s rows when given."""

    def __init__(self, lm, references: Dict[Hashable, Sequence[int]], profile: Sequence[float], seed: int = 0,
                 draft_head=None):
        super().__init__(lm, drafter=ReplayedDrafter(references, profile, lm.vocab_size, seed, draft_head))
