"""Replayed acceptance: drafts scripted to a given acceptance profile, for benchmarks of random models.

A random-weight model's head never drafts the trunk's token, so its rounds would all be rejections
and say nothing of what a trained head earns. Here the real head still runs every draft step (its
cost is real); each draft is then replaced by the token plain greedy decoding wrote at that
position (known from a reference run) or by a wrong one, so that draft position j is accepted
with probability profile[j]. Verify, acceptance, rollback and the head rows run for real, and the
output is still the plain greedy text. Used only by the benchmark: no server or CLI path makes one.

Over a draft vocabulary (`draft_head`, a DraftLMHead) the head projects onto the subset's rows only,
as `--draft-vocab` does, and every scripted draft is one of the subset's ids: a reference token
outside it cannot be drafted, so its position counts as a miss.
"""

import bisect
import random
from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx

from ..engine import Speculator
from ..errors import DynoError
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


class ReplayedSpeculator(Speculator):
    """A Speculator whose drafts follow `profile`: position j right with probability profile[j]."""

    def __init__(self, lm, params, depth: int, prefill_step: int, draft_vocab, reference: Sequence[int],
                 profile: Sequence[float], seed: int = 0, draft_head=None):
        if not params.greedy:
            raise DynoError("replayed acceptance scripts greedy drafts only")
        # A random model has no ranking of its own: the caller's subset stands in for `draft_vocab`'s.
        super().__init__(lm, params, depth, prefill_step, None if draft_head is not None else draft_vocab)
        self.subset: Optional[list] = None
        if draft_head is not None:
            self.draft_lm_head = draft_head
            self.subset = draft_head.ids.tolist()  # sorted
            self.in_subset = set(self.subset)
        self.reference, self.profile = list(reference), list(profile)
        self.rng = random.Random(seed)  # its own stream: the same rounds for every run with this seed
        self.vocab = lm.vocab_size

    def _wrong(self, true: Optional[int]) -> int:
        """A token other than `true`: the next id, or the subset's next id over a draft vocabulary."""
        if self.subset is None:
            return ((true or 0) + 1) % self.vocab
        return self.subset[bisect.bisect_right(self.subset, -1 if true is None else true) % len(self.subset)]

    def draft(self, k: int):
        """The head's k drafts, computed, then swapped for scripted ones."""
        drafts, probs = super().draft(k)
        start = len(self.generated)  # drafts are for generated[start], generated[start + 1], ...
        # One uniform per round: `right` leading drafts are the reference's, so P(position j accepted)
        # = P(right >= j) = profile[j - 1] for a non-increasing profile.
        u = self.rng.random()
        right = sum(u < a for a in self.profile[:k])
        scripted = []
        for j in range(k):
            i = start + j
            true = self.reference[i] if i < len(self.reference) else None
            draftable = true is not None and (self.subset is None or true in self.in_subset)
            scripted.append(true if j < right and draftable else self._wrong(true))
        # where() reads the head's drafts, so evaluating the scripted ones still runs the head
        keep = mx.ones((k,), dtype=mx.bool_)
        return mx.where(keep, mx.array(scripted, dtype=drafts.dtype), drafts), probs


def replayed_runner(reference: Sequence[int], profile: Sequence[float], seed: int = 0, draft_head=None) -> Callable:
    """engine.generate's `runner` seam: a ReplayedSpeculator against `reference`, the plain greedy
    tokens of the same prompt (as many as the run generates, plus its depth); drafting over
    `draft_head`'s subset when given."""
    def make(lm, params, spec, prefill_step):
        return ReplayedSpeculator(lm, params, spec.draft_depth, prefill_step, spec.draft_vocab, reference,
                                  profile, seed, draft_head)
    return make
