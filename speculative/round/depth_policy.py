"""The batched cost model and the depth each round drafts at (the round is ../round; measure/batch_cost.py
measures the costs on this model and machine).

V(B, t): seconds for one round's trunk pass over B rows of t = k+1 tokens (at t = 1 the plain
forward of a depth-0 round; at t > 1 the verify pass and the head's rows after it). D(B): seconds
per draft step for B rows (the head's pick and its next row). A round at depth k for B rows then
delivers B * E(k) tokens in V(B, k+1) + k * D(B) seconds, E(k) = 1 + the acceptance at positions
1..k (E(0) = 1). DepthPolicy picks the shallowest k in 0..K within MARGIN of the most tokens per
second, with the acceptance learned from the rounds it sees; as rows are added a verify pass fills up, the draft
costs grow with it, and at some width depth 0 (plain batched decoding) wins.

The tuned V and D are timed apart from real rounds, on a machine whose speed drifts; a round also
costs what they leave out (acceptance, rollback, the host sync). So the policy times the rounds it
runs (RoundClock) and trusts those times over the tuned ones, which only say how depths it has not
yet timed compare; every EXPLORE_EVERY rounds at a width it may time a neighbouring depth (a far
one rarely: EXPLORE_BUDGET), so a better depth is found and the estimates follow the machine.
"""

import statistics
import time
from collections import deque
from typing import Dict, Iterable, List, Optional, Sequence

from ..config import MAX_DRAFT_DEPTH
from ..events import Round

# The prior counts as this many rounds at each position: the measured acceptance takes over
# within a few rounds, and a position drafted rarely keeps near the prior.
PRIOR_ROUNDS = 8.0
# Each observed round's counts weigh this much less per later round: acceptance follows the text
# being written (code, prose, a repeated passage), so recent rounds speak for the next one.
FORGET = 0.99
# A round's time counts once its depth ran the round before too, and when it queued work for its
# own depth: the first round at a new depth pays the switch (the head's owed rows, a new shape's
# first compile), and the last pays for some of the next round's work (MLX's CPU backend runs much
# of an async_eval on the calling thread), not for the depth itself.
# The estimate is typical() of the last WINDOW such times: one slow round from elsewhere moves it
# little, a lasting change follows within a few rounds.
WINDOW = 9
# Every this many rounds at a width, EXPLORE_RUN rounds go to a neighbour of the best depth
# (deeper and shallower in turn); the middle one is timed.
EXPLORE_EVERY = 24
EXPLORE_RUN = 3
# A neighbour's turn is not free: its rounds deliver at its rate, not the best depth's, and a switch
# in and out costs about one more round (the head's owed rows, the work queued for the other depth).
# Past its first FAR_EVIDENCE timed rounds (the tuned costs can be wrong, and so can one round:
# scratch, one row, a first depth-1 round timed at 1.4x its steady time kept a whole wave at depth 0),
# a neighbour is timed once the rounds at this width since its last turn put what its next turn is
# expected to lose within EXPLORE_BUDGET of their time: a close neighbour every turn, a far one
# rarely. With a fixed spacing (every eighth turn below 0.9 of the best rate) a far depth 1 took 3-9
# rounds of each 4-client wave at 3.3x a plain round (bundled model, 4 rows: 48 ms against 14.6), its
# verify passes 3.3% of the engine thread's time (scratch, py-spy).
EXPLORE_BUDGET = 0.01
FAR_EVIDENCE = 3
# The policy drafts at the shallowest depth within MARGIN of the best rate: a deeper round costs
# what its timed rounds leave out (the switch into it, the head's owed rows after plain rounds), and
# 5% is under a timed round's noise here. Without it, at 4 rows, where depth 1 runs at 0.94x of
# depth 0 (tools/batched_speed.py --rows 4), one server in four spent a third of its rounds at
# depth 1 (tools/serve_concurrency.py waves at 4 clients, scratch).
MARGIN = 0.95


def interpolate(table: Dict[int, float], width: int) -> float:
    """table[width], linear between the measured widths around it, extended along the last two beyond."""
    if width in table:
        return table[width]
    ws = sorted(table)
    if len(ws) == 1:
        return table[ws[0]] * width / ws[0]
    lo, hi = (ws[0], ws[1]) if width < ws[0] else (ws[-2], ws[-1]) if width > ws[-1] else next(
        (a, b) for a, b in zip(ws, ws[1:]) if a < width < b)
    return table[lo] + (table[hi] - table[lo]) * (width - lo) / (hi - lo)


class BatchCosts:
    """Measured V(B, t) and D(B) in seconds, with V for unmeasured widths interpolated; and, where
    measured, R(B, k): a whole round's seconds at depth k, as BatchSpeculator.step runs it."""

    def __init__(self, verify: Dict[int, Dict[int, float]], draft: Dict[int, float],
                 rounds: Optional[Dict[int, Dict[int, float]]] = None):
        self.verify = {int(b): {int(t): float(s) for t, s in row.items()} for b, row in verify.items()}
        self.draft = {int(b): float(s) for b, s in draft.items()}
        self.rounds = ({int(b): {int(k): float(s) for k, s in row.items()} for b, row in rounds.items()}
                       if rounds else None)

    @property
    def max_depth(self) -> int:
        return min(max(row) for row in self.verify.values()) - 1

    def V(self, width: int, tokens: int) -> float:
        """Seconds of one round's trunk pass over `width` rows of `tokens` tokens each."""
        return interpolate({b: row[tokens] for b, row in self.verify.items()}, width)

    def D(self, width: int) -> float:
        """Seconds per draft step for `width` rows."""
        return interpolate(self.draft, width)

    def round(self, width: int, depth: int) -> float:
        """Seconds of a round at `depth` for `width` rows: R where measured, else V(B, k+1) + k·D(B)."""
        if self.rounds is not None and all(depth in row for row in self.rounds.values()):
            return interpolate({b: row[depth] for b, row in self.rounds.items()}, width)
        return self.V(width, depth + 1) + depth * self.D(width)

    def as_json(self) -> dict:
        out = {"V": _keyed(self.verify), "D": {str(b): s for b, s in self.draft.items()}}
        return {**out, "R": _keyed(self.rounds)} if self.rounds else out

    @classmethod
    def from_json(cls, data: dict) -> "BatchCosts":
        return cls(data["V"], data["D"], data.get("R"))


def _keyed(table: Dict[int, Dict[int, float]]) -> dict:
    return {str(b): {str(t): s for t, s in row.items()} for b, row in table.items()}


def typical(times) -> float:
    """A cell's seconds per round from its kept times: their mean, the slowest one left out. The rate is
    the mean's (rare slow rounds, a head catch-up or a collection, are part of it; a median hid them and
    made plain rounds look 5-10% cheaper against drafting ones, scratch at one row); one slow round from
    elsewhere moves it little."""
    times = sorted(times)
    # Plain float sums: statistics.mean sums exact fractions (the policy took 237 µs a round
    # with it, 47 without; scratch).
    return sum(times[:-1]) / (len(times) - 1) if len(times) > 2 else statistics.median(times)


class RoundClock:
    """Seconds per round at each (width, depth), from the rounds a policy ran; the tuned costs,
    scaled to what the timed rounds say of them, for a cell not yet timed.

    The machine's speed drifts, and a depth in use is timed every round while the others are timed
    only now and then: compared as they were taken, a slow spell would make every depth not in use
    look cheap. So each time is kept divided by `speed`, how slow the machine runs now, and the cells
    compare in those units. `speed` is the median of what the last rounds said of it against their
    cell's reference: typical() of its first WINDOW kept times, then fixed (against the kept times
    themselves, each divided by the speed of its day, the estimate would wander with the noise).
    """

    def __init__(self, costs: BatchCosts):
        self.costs = costs
        self.times: Dict[tuple, deque] = {}  # (width, depth) -> the last WINDOW steady rounds, / speed
        self.speed = 1.0
        self.speeds: deque = deque(maxlen=WINDOW)  # what the last timed rounds said of it
        self.refs: Dict[tuple, float] = {}  # a cell's first WINDOW kept times' median, in `speed` units
        self._ratios: Optional[Dict[tuple, float]] = None  # timed/tuned per timed cell, until the next record
        self.last: Optional[tuple] = None  # the previous round's (width, depth)

    def record(self, width: int, depth: int, seconds: float, then: Optional[int] = None) -> None:
        """A round's wall time; `then`: the depth it queued work for (None: its own)."""
        cell = (width, depth)
        self._ratios = None
        if cell == self.last and then in (None, depth):
            kept = self.times.setdefault(cell, deque(maxlen=WINDOW))
            if cell in self.refs:  # this round against its cell's reference: how slow the machine runs now
                self.speeds.append(seconds / self.refs[cell])
                self.speed = statistics.median(self.speeds)
            kept.append(seconds / self.speed)
            if cell not in self.refs and len(kept) == WINDOW:
                self.refs[cell] = typical(kept)
        self.last = cell

    def tuned(self, width: int, depth: int) -> float:
        return self.costs.round(width, depth)

    def seconds(self, width: int, depth: int) -> float:
        """The measured seconds of a round at `depth` for `width` rows at today's speed, else the tuned
        estimate scaled by the median ratio of measured to tuned at this width (any width when none here)."""
        if (width, depth) in self.times:
            return self.speed * typical(self.times[(width, depth)])
        if self._ratios is None:  # once per round, not once per depth asked about
            self._ratios = {c: typical(t) / self.tuned(*c) for c, t in self.times.items()
                            if self.tuned(*c) > 0}
        here = [r for (w, _), r in self._ratios.items() if w == width] or list(self._ratios.values())
        return self.speed * self.tuned(width, depth) * (statistics.median(here) if here else 1.0)


class RoundTimer:
    """Each round's seconds from its start to the next round's start, handed to `record(width, depth,
    seconds, then)`: the host's work between rounds (handing tokens out, the policy itself) is paid once
    a round, so a plain round, one token a row, pays it most, and step() alone leaves it out."""

    def __init__(self, record):
        self.record = record
        self.open: Optional[tuple] = None  # (width, depth, then, start) of the round running now

    def start(self, width: int, depth: int, then: Optional[int] = None) -> None:
        """A round starts: the one before it, if timed, ends here."""
        now = time.perf_counter()
        if self.open is not None:
            w, k, t, began = self.open
            self.record(w, k, now - began, t)
        self.open = (width, depth, then, now)

    def skip(self) -> None:
        """Something besides rounds runs before the next one (a row's prefill, an idle wait): the round
        running now goes untimed."""
        self.open = None


class DepthPolicy:
    """Each round's draft depth for the rows in the batch: `depth_for(width)` (and `peek(width)`, the
    next round's, for the work the round queues), then `observe` the round's events and `record` its
    seconds.

    `pinned` (a `--draft-depth N`) fixes the depth; otherwise the best by cost (within MARGIN), with acceptance
    learned online from the rounds observed, starting from `prior` (rates at positions 1, 2, ...),
    and round times learned from the rounds timed (RoundClock), starting from `costs`.

    `single`: the depth for one row, the single-request engine's (`dyno tune`'s, chosen from whole
    runs at each depth). One row is that engine's round, and there the online estimates, a few noisy
    rounds per depth with 5-15% between the best depths, chose worse (scratch, one row, 6 waves: the
    policy 0.82x serial drafting, rounds at the tuned depth 0.96x).
    """

    def __init__(self, costs: Optional[BatchCosts], prior: Sequence[float], max_depth: int = MAX_DRAFT_DEPTH,
                 pinned: Optional[int] = None, single: Optional[int] = None, per_row: bool = False):
        """`per_row`: each row may draft shallower than the round, 0 included (round/row_depth.py), as
        "auto" asks; a depth the user gave is kept as given."""
        if costs is None and pinned is None:
            raise ValueError("a depth policy needs costs or a pinned depth")
        self.costs, self.pinned, self.max_depth, self.single = costs, pinned, max_depth, single
        self.per_row = per_row
        self.prior = list(prior)[:max_depth] + [0.0] * (max_depth - len(prior))
        self.accepted = [0.0] * max_depth  # decayed counts per position
        self.drafted = [0.0] * max_depth
        self.chosen: Dict[int, Dict[int, int]] = {}  # width -> depth -> rounds: what was picked over time
        self.clock = RoundClock(costs) if costs is not None else None
        self.rounds: Dict[int, int] = {}  # width -> rounds chosen at it (the exploration schedule)
        self.exploring: Dict[int, Optional[int]] = {}  # width -> the neighbour this turn times, if any
        self.timed_turn: Dict[tuple, int] = {}  # (width, depth) -> the last turn that timed it

    @property
    def deepest(self) -> int:
        """The deepest depth a round may draft at (what a row's memory is sized for)."""
        if self.pinned is not None:
            return self.pinned
        return min(self.max_depth, self.costs.max_depth)

    def acceptance(self) -> List[float]:
        """Acceptance rate per draft position: the observed rounds, with the prior as PRIOR_ROUNDS more."""
        return [(a + PRIOR_ROUNDS * p) / (d + PRIOR_ROUNDS)
                for a, d, p in zip(self.accepted, self.drafted, self.prior)]

    def depth_for(self, width: int) -> int:
        """The depth to draft at this round for `width` rows (0: a plain batched round)."""
        k = self._next(width, commit=True)
        counts = self.chosen.setdefault(width, {})
        counts[k] = counts.get(k, 0) + 1
        return k

    def peek(self, width: int) -> int:
        """The depth the next round at `width` rows will likely take (what this round queues work
        for): depth_for's choice, computed without counting it."""
        return self._next(width, commit=False)

    def _next(self, width: int, commit: bool) -> int:
        if self.pinned is not None:
            return self.pinned
        if width <= 0:
            return 0
        if width == 1 and self.single is not None:
            return min(self.single, self.deepest)
        k = self.best_depth(width)
        n = self.rounds.get(width, 0) + 1
        turn, phase = divmod(n, EXPLORE_EVERY)
        exploring = self.exploring.get(width)
        if phase == EXPLORE_EVERY - EXPLORE_RUN:  # a turn starts: which neighbour, if any
            exploring = self._neighbour(width, k, turn)
            if commit and exploring is not None:
                self.timed_turn[width, exploring] = turn
        if commit:
            self.rounds[width], self.exploring[width] = n, exploring
        if phase >= EXPLORE_EVERY - EXPLORE_RUN and exploring is not None:
            k = exploring
        return k

    def _neighbour(self, width: int, best: int, turn: int) -> Optional[int]:
        """The depth to time on exploration turn `turn`: deeper and shallower than `best` in turn; none
        while what its turn is expected to lose is more than EXPLORE_BUDGET of the time at this width
        since its last turn."""
        step = 1 if turn % 2 else -1
        if not 0 <= best + step <= self.deepest:
            step = -step
        k = best + step
        if not 0 <= k <= self.deepest:
            return None
        if len(self.clock.times.get((width, k), ())) < FAR_EVIDENCE:  # too few timed rounds to judge it
            return k
        rates = self.expected_rates(width)
        loss = (EXPLORE_RUN + 1) * self.clock.seconds(width, k) * max(0.0, 1.0 - rates[k] / rates[best])
        since = (turn - self.timed_turn.get((width, k), 0)) * EXPLORE_EVERY * self.clock.seconds(width, best)
        return k if loss <= EXPLORE_BUDGET * since else None

    def best_depth(self, width: int) -> int:
        """The shallowest depth within MARGIN of the most tokens per second for `width` rows."""
        if self.pinned is not None:
            return self.pinned
        rates = self.expected_rates(width)
        top = max(rates.values())
        return min(k for k, r in rates.items() if r >= MARGIN * top)

    def record(self, width: int, depth: int, seconds: float, then: Optional[int] = None) -> None:
        """The wall time of a round at `depth` for `width` rows, from its start to the next round's
        (RoundTimer), which queued work for a round at depth `then` (None: its own depth)."""
        if self.clock is not None:
            self.clock.record(width, depth, seconds, then)

    def observe(self, events: Iterable) -> None:
        """Fold one round's events (any mix; its Round events count): which positions each row
        drafted and which the trunk accepted."""
        rounds = [e for e in events if isinstance(e, Round) and e.drafted and e.source == "head"]  # the head's acceptance
        if not rounds:
            return
        self.accepted = [a * FORGET for a in self.accepted]
        self.drafted = [d * FORGET for d in self.drafted]
        for r in rounds:
            for i in range(min(r.drafted, self.max_depth)):
                self.drafted[i] += 1
                self.accepted[i] += i < r.accepted

    def expected_rates(self, width: int) -> Dict[int, float]:
        """Tokens per second at each depth for `width` rows, as the policy sees them now."""
        if self.costs is None:
            return {}
        acceptance = self.acceptance()
        return {k: width * (1.0 + sum(acceptance[:k])) / self.clock.seconds(width, k)
                for k in range(self.deepest + 1)}
