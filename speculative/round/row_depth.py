"""Each row's own draft depth, for requests decoded alone and in batches alike: the shallowest depth
within MARGIN of the most tokens per second from the row's own recent acceptance and the measured seconds of a round at
its width, depth and context length, 0 included (the row parks: it decodes plain).

Acceptance falls as a context grows (published: Qwen3.6-27B's first position from 0.935 to 0.721;
llama.cpp at parity with plain decoding near 86k tokens), while each verify row costs more there
(attention over the whole cache), so the best depth moves down and reaches 0. A parked row drafts
one token now and then (a probe) to see whether acceptance came back: after a probe that fails the
next waits twice as long, up to the spacing at which probing costs PROBE_BUDGET of the row's time;
one that succeeds brings the next probe close and starts the row's counts again from its prior, so a
row whose acceptance returns (a quoted span, a new topic) drafts again within a few rounds.

Round times come from the rounds themselves (RoundTimes: the policy's RoundClock, one per context
band), so "depth 3 at 1k" and "depth 1 at 32k" come out of the same numbers; a depth not yet timed
at a band is the tuned costs' (the batched policy's, else VERIFY_STEP per draft) scaled by the timed.
"""

import math
from typing import Callable, Dict, List, Optional, Sequence

from ..config import MAX_DRAFT_DEPTH
from ..events import Round
from .depth_policy import MARGIN, RoundClock

# The row's prior acceptance (the pooled rounds' at its join) counts as this many of its rounds;
# each round of its own makes all earlier counts, the prior's too, weigh ROW_FORGET less: a row
# follows its own text quickly.
ROW_PRIOR = 4.0
ROW_FORGET = 0.9
# A depth not timed at a band costs, per draft, this share of a plain round more than depth 0 (a
# bandwidth-bound verify row is cheap, a draft step is a head layer and a projection): an estimate
# only until the rounds there are timed.
VERIFY_STEP = 0.2
# A parked row's first probe comes after PROBE_FIRST plain rounds; each failed probe doubles the
# spacing, up to where a probe's extra time is PROBE_BUDGET of the plain rounds between probes.
PROBE_FIRST = 2
PROBE_BUDGET = 0.01
PROBE_SHARE = 0.7  # of the budget, at the widest spacing: the rest is the ramp up to it
PROBE_MAX = 512
# Past the first position, the row's rate at the position before, falling off as the prior does,
# stays as this many rounds' worth under the counts: a position the row has not drafted lately (it
# drafts shallower now) drifts towards what its shallower ones say, so a deeper depth is tried again.
PRIOR_FLOOR = 0.5
# Context bands of the round times: under 1k tokens, then one per doubling.
BAND_BASE = 1024


def context_band(tokens: int) -> int:
    """The band of a context of `tokens` tokens: 0 under 2 * BAND_BASE, then one per doubling."""
    return max(0, int(math.log2(max(tokens, 1) / BAND_BASE)))


class StepCosts:
    """Round costs in units of a plain round, VERIFY_STEP more per draft: RoundClock's tuned costs
    where none were measured (a request decoded alone)."""

    def round(self, width: int, depth: int) -> float:
        return 1.0 + VERIFY_STEP * depth


class RoundTimes:
    """Seconds of a round by (width, depth, context band): a RoundClock per band (the machine's drift
    divided out, a cell not timed yet from `costs` scaled by the timed ones), a band not timed yet
    answered by the nearest one that was."""

    def __init__(self, costs=None):
        self.costs = costs if costs is not None else StepCosts()
        self.clocks: Dict[int, RoundClock] = {}

    def record(self, width: int, depth: int, band: int, seconds: float, then: Optional[int] = None) -> None:
        self.clocks.setdefault(band, RoundClock(self.costs)).record(width, depth, seconds, then)

    def seconds(self, width: int, depth: int, band: int) -> float:
        """A round's seconds (or units of StepCosts while nothing was timed) at this width, depth and band."""
        timed = [b for b, c in self.clocks.items() if any(w == width for w, _ in c.times)]
        if not timed:
            return self.costs.round(width, depth)
        nearest = min(timed, key=lambda b: (abs(b - band), -b))
        return self.clocks[nearest].seconds(width, depth)


class RowDepth:
    """One row's depth each round (choose) from its own acceptance (observe its Rounds)."""

    def __init__(self, prior: Sequence[float], max_depth: int = MAX_DRAFT_DEPTH):
        self.prior = (list(prior) + [0.0] * max_depth)[:max_depth]
        self._fresh()
        self.parked = False
        self.waited = 0  # plain rounds since it parked or last probed
        self.spacing = PROBE_FIRST  # plain rounds before its next probe
        self.probing = False
        self.probes = 0  # probe rounds so far (a parked row's only drafting rounds)
        self.widest = PROBE_MAX  # the most plain rounds between probes (set from the round times)

    def acceptance(self) -> List[float]:
        """Acceptance by position, never above the position before (a draft is kept only after the
        ones before it: a position drafted less often must not look better)."""
        out = []
        for i, (a, d) in enumerate(zip(self.accepted, self.drafted)):
            if i == 0:  # drafted by every drafting round and probe: its counts alone
                out.append(a / d if d > 0 else self.prior[0])
                continue
            # Past it, the counts over the position before's, shaped as the prior falls off.
            p, before = self.prior[i], self.prior[i - 1]
            shaped = out[-1] * p / before if before > 0 else 0.0
            out.append(min(out[-1], (a + PRIOR_FLOOR * shaped) / (d + PRIOR_FLOOR)))
        return out

    def _fresh(self) -> None:
        """Counts as at the row's start: the prior as ROW_PRIOR rounds of them (they fade as rounds come)."""
        self.accepted = [ROW_PRIOR * p for p in self.prior]
        self.drafted = [ROW_PRIOR] * len(self.prior)

    def rates(self, ceiling: int, seconds: Callable[[int], Optional[float]]) -> Optional[Dict[int, float]]:
        """Tokens per second at each depth 0..ceiling for this row; None while round times are unknown."""
        times = {k: seconds(k) for k in range(ceiling + 1)}
        if any(t is None or t <= 0 for t in times.values()):
            return None
        acceptance = self.acceptance()
        return {k: (1.0 + sum(acceptance[:k])) / times[k] for k in times}

    def choose(self, ceiling: int, seconds: Callable[[int], Optional[float]]) -> int:
        """The row's depth this round, at most `ceiling` (the round's): its best rate's, or 0 while it
        pays less than plain decoding (parked), with a depth-1 probe when one is due."""
        rates = self.rates(ceiling, seconds) if ceiling > 0 else None
        if rates is None:
            return ceiling
        top = max(rates.values())
        best = min(k for k, r in rates.items() if r >= MARGIN * top)  # as the policy: the shallowest near the top
        if best > 0:
            self.parked, self.waited, self.spacing = False, 0, PROBE_FIRST
            return best
        if not self.parked:
            self.parked, self.waited = True, 0
        self.waited += 1
        if self.waited < self.spacing:
            return 0
        # A probe costs its round's extra seconds; spaced so that its share stays under PROBE_BUDGET.
        extra = max(0.0, seconds(1) / seconds(0) - 1.0)
        self.widest = min(PROBE_MAX, max(PROBE_FIRST, math.ceil(extra / (PROBE_SHARE * PROBE_BUDGET))))
        self.waited, self.probing = 0, True
        self.probes += 1
        return 1

    def observe(self, event: Optional[Round]) -> None:
        """The row's Round this round (None when it drafted nothing): its acceptance by position, and a
        probe's outcome (spacing the next one further, or bringing it close)."""
        if event is None or not event.drafted or event.source != "head":
            self.probing = False
            return
        if self.probing:
            came_back = event.accepted > 0
            if came_back:  # its text changed: start again from the prior
                self._fresh()
            self.spacing = PROBE_FIRST if came_back else min(2 * self.spacing, self.widest)
            self.probing = False
        self.accepted = [a * ROW_FORGET for a in self.accepted]
        self.drafted = [d * ROW_FORGET for d in self.drafted]
        for i in range(min(event.drafted, len(self.drafted))):
            self.drafted[i] += 1
            self.accepted[i] += i < event.accepted
