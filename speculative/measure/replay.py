"""Replayed acceptance: drafts scripted to a given acceptance profile, for benchmarks of random models.

A random-weight model's head never drafts the trunk's token, so its rounds would all be rejections
and say nothing of what a trained head earns. Here the real head still runs every draft step (its
cost is real); each draft is then replaced by the token plain greedy decoding wrote at that
position (known from a reference run) or by a wrong one, so that draft position j is accepted
with probability profile[j]. Verify, acceptance, rollback and the head rows run for real, and the
output is still the plain greedy text. Used only by the benchmarks: no server or CLI path makes one.
It is a drafter (round/drafter.py), so it runs at any width, each row against its own reference.

A profile may depend on the context (ContextProfile: rates by position at a few context lengths,
linear between them), as a real head's acceptance decays over a long session; a round then drafts
to the rates at its row's context (prompt and tokens generated so far).

Over a draft vocabulary (`draft_head`, a DraftLMHead) the head projects onto the subset's rows only,
as `--draft-vocab` does, and every scripted draft is one of the subset's ids: a reference token
outside it cannot be drafted, so its position counts as a miss.
"""

import bisect
import random
import re
from dataclasses import dataclass
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


Rates = Tuple[float, ...]


@dataclass(frozen=True)
class ContextProfile:
    """Acceptance by draft position that depends on the context: `points` of (context tokens, rates),
    contexts increasing, every point as many positions; linear between points, the end points'
    rates before the first and past the last."""

    points: Tuple[Tuple[int, Rates], ...]

    def at(self, context: int) -> Rates:
        """The rates by position at `context` tokens."""
        contexts = [c for c, _ in self.points]
        i = bisect.bisect_right(contexts, context)
        if i == 0:
            return self.points[0][1]
        if i == len(self.points):
            return self.points[-1][1]
        (c0, r0), (c1, r1) = self.points[i - 1], self.points[i]
        t = (context - c0) / (c1 - c0)
        return tuple(a + t * (b - a) for a, b in zip(r0, r1))

    def __len__(self) -> int:
        return len(self.points[0][1])


Profile = Union[Rates, ContextProfile]

# Qwen3.6-27B's position-1 acceptance falls from 93.5% at short context to 72.1% at long context
# (vLLM issue #47602, vLLM, num_speculative_tokens=6); llama.cpp's Qwen3.8-27B in the same thread
# accepts 40-55% at ~86k tokens, where drafting reached parity with plain decoding. No per-position
# figures came with them: positions 2 and 3 are 27b-code's at 1k, scaled by position 1's fall.
_SHORT = (0.935, 0.86, 0.75)
CONTEXT_PROFILES: Dict[str, ContextProfile] = {
    "27b-long": ContextProfile(tuple((context, tuple(round(r * p1 / _SHORT[0], 4) for r in _SHORT))
                                     for context, p1 in ((1024, 0.935), (32768, 0.721), (86016, 0.475)))),
}


def _rates(text: str, whole: str) -> Rates:
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise DynoError(f"acceptance must be one of {', '.join([*PROFILES, *CONTEXT_PROFILES])}, rates like "
                        f"0.93,0.86,0.75 or points like 1k:0.93,0.86,0.75/32k:0.72,0.66,0.58: {whole!r}") from None
    if not rates or any(not 0 <= r <= 1 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
        raise DynoError(f"acceptance rates must be non-increasing and within [0, 1]: {whole!r}")
    return rates


def _tokens(text: str, whole: str) -> int:
    m = re.fullmatch(r"(\d+)([kK]?)", text.strip())
    if not m or int(m.group(1)) == 0:
        raise DynoError(f"a profile point's context must be a number of tokens such as 8192 or 8k: {whole!r}")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def parse_profile(text: str, by_context: bool = False) -> Profile:
    """A profile by name (PROFILES) or as comma-separated rates, non-increasing, each in [0, 1];
    `by_context`: also a ContextProfile, by name (CONTEXT_PROFILES) or as points CONTEXT:RATES
    joined by '/' (1k = 1024 tokens)."""
    if text in PROFILES:
        return PROFILES[text]
    if text in CONTEXT_PROFILES or ":" in text:
        if not by_context:
            raise DynoError(f"this takes acceptance rates by position, not a profile by context: {text!r}")
        if text in CONTEXT_PROFILES:
            return CONTEXT_PROFILES[text]
    else:
        return _rates(text, text)
    points = []
    for part in text.split("/"):
        context, sep, rates = part.partition(":")
        if not sep:
            raise DynoError(f"every point of a context profile is CONTEXT:RATES: {text!r}")
        points.append((_tokens(context, text), _rates(rates, text)))
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise DynoError(f"a context profile's contexts must increase: {text!r}")
    if len({len(r) for _, r in points}) != 1:
        raise DynoError(f"every point of a context profile needs as many positions: {text!r}")
    return ContextProfile(tuple(points))


def rates_at(profile: Profile, context: int) -> Rates:
    """The rates by position of `profile` at `context` tokens (a constant profile's at any)."""
    return profile.at(context) if isinstance(profile, ContextProfile) else tuple(profile)


class Script:
    """Scripted drafts against one reference: each round, position j right with probability profile[j]
    (one uniform per round, seeded by the round's start: `right` leading drafts are the reference's,
    so P(position j accepted) = P(right >= j) = profile[j - 1] for a non-increasing profile; a
    ContextProfile's rates are those at the round's context). Over a draft vocabulary (`subset`,
    sorted ids) a reference token outside it cannot be drafted: its position is a miss."""

    def __init__(self, reference: Sequence[int], profile: Profile, vocab: int, subset=None,
                 seed: Union[int, str] = 0):
        self.reference, self.profile, self.vocab = list(reference), profile, vocab
        self.subset, self.seed = subset, seed
        self.in_subset = set(subset) if subset is not None else None

    def _wrong(self, true: Optional[int]) -> int:
        """A token other than `true`: the next id, or the subset's next id over a draft vocabulary."""
        if self.subset is None:
            return ((true or 0) + 1) % self.vocab
        return self.subset[bisect.bisect_right(self.subset, -1 if true is None else true) % len(self.subset)]

    def drafts(self, start: int, k: int, context: int = 0) -> List[int]:
        """k drafts for reference[start], reference[start + 1], ...: the same for a position however
        often it is drafted (a batch drafts again what a join or a leave took back), so a row's
        rounds do not depend on the rows beside it, and every run with this seed has the same.
        `context`: the row's tokens before reference[start], for a ContextProfile."""
        u = random.Random(f"{self.seed}/{start}").random()
        right = sum(u < a for a in rates_at(self.profile, context)[:k])
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

    def __init__(self, references: Dict[Hashable, Sequence[int]], profile: Profile, vocab: int,
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
        rows = [self.scripts[r.id if r.id in self.scripts else None].drafts(len(r.generated), k,
                                                                           len(r.prompt) + len(r.generated))
                for r in rounds.rows]
        return drafts._replace(tokens=scripted(drafts.tokens, rows))


def replayed_drafter(lm, reference: Sequence[int], profile: Profile, seed: int = 0,
                     draft_head=None) -> ReplayedDrafter:
    """engine.generate's `drafter`: replayed drafts against `reference`, the plain greedy tokens of
    the same prompt (as many as the run generates, plus its depth), over `draft_head`'s rows when given."""
    return ReplayedDrafter({None: reference}, profile, lm.vocab_size, seed, draft_head, row_seeds=False)


def replayed_batch(lm, references: Dict[Hashable, Sequence[int]], profile: Profile, seed: int = 0,
                   draft_head=None) -> BatchSpeculator:
    """The one driver drafting by a ReplayedDrafter, each row against `references[row_id]` and its own
    seed; the draft step over `draft_head`'s rows when given."""
    return BatchSpeculator(lm, drafter=ReplayedDrafter(references, profile, lm.vocab_size, seed, draft_head))
