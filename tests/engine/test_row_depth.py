"""Each row's own depth (speculative/round/row_depth.py): it parks where drafting stops paying, probes
at a spacing that keeps probing under 1% of its time, comes back when acceptance does, and picks a
shallower depth at a long context from the same acceptance; decoding stays exact throughout."""

from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Round, Token
from speculative.measure.replay import parse_profile, replayed_drafter
from speculative.round.depth_policy import DepthPolicy
from speculative.round.row_depth import (PROBE_BUDGET, PROBE_FIRST, VERIFY_STEP, RoundTimes, RowDepth,
                                         context_band)

CHEAP = {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6}  # seconds of a round by depth: each draft 20% of a plain round


def run(row: RowDepth, rounds: int, accepts, seconds=CHEAP.get, ceiling: int = 3):
    """`rounds` rounds of `row` (accepts(i, depth) -> accepted drafts of round i): its depth per round."""
    depths = []
    for i in range(rounds):
        k = row.choose(ceiling, seconds)
        depths.append(k)
        row.observe(Round(k, min(k, accepts(i, k))) if k else None)
    return depths


def test_a_row_whose_drafts_never_pay_parks_and_probes_under_one_percent_of_its_time():
    row = RowDepth([0.8, 0.6, 0.4])
    depths = run(row, 4000, lambda i, k: 0)
    first_park = depths.index(0)
    assert first_park <= 12  # the prior (4 rounds' worth) gives way within a dozen rounds
    probes = [i for i, k in enumerate(depths) if i > first_park and k > 0]
    assert all(depths[i] == 1 for i in probes)  # a probe drafts one token
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 20  # each failed probe waits longer
    # A probe's extra time (a depth-1 round for a plain one) against all of the parked rounds' time.
    parked = depths[first_park:]
    extra = sum(CHEAP[k] - CHEAP[0] for k in parked)
    assert extra / sum(CHEAP[k] for k in parked) < PROBE_BUDGET


def test_a_parked_row_drafts_again_within_a_few_rounds_once_its_drafts_are_accepted():
    row = RowDepth([0.8, 0.6, 0.4])
    run(row, 1000, lambda i, k: 0)  # parked, probing at its widest spacing
    assert row.parked and row.spacing > 16
    depths = run(row, 400, lambda i, k: k)  # from now on every draft is accepted
    probe = depths.index(1)  # the next probe (due within the spacing) succeeds...
    back = next(i for i in range(probe + 1, len(depths)) if depths[i] > 1)  # ...and it drafts deep again
    assert back - probe <= 3 * PROBE_FIRST, depths[probe:back + 1]
    assert not row.parked and depths[-1] == 3


def test_the_same_acceptance_drafts_deep_at_a_short_context_and_shallow_at_a_long_one():
    """Round times by context band: verify rows grow dearer at 32k (attention over the whole cache)."""
    times = RoundTimes()
    for k, s in {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}.items():
        for _ in range(3):
            times.record(1, k, context_band(1000), s)
    for k, s in {0: 2.0, 1: 3.0, 2: 4.0, 3: 5.0}.items():
        for _ in range(3):
            times.record(1, k, context_band(32_000), s)
    assert context_band(1000) == 0 and context_band(32_000) == 4
    row = RowDepth([0.6, 0.5, 0.4])
    assert row.choose(3, lambda k: times.seconds(1, k, context_band(1000))) == 3
    assert row.choose(3, lambda k: times.seconds(1, k, context_band(32_000))) == 1
    # A band not timed yet takes the nearest one's times; a width not timed, the step costs' units.
    assert times.seconds(1, 2, context_band(12_000)) == times.seconds(1, 2, context_band(32_000)) == 4.0
    assert times.seconds(2, 3, 0) == 1.0 + 3 * VERIFY_STEP


def test_alone_under_auto_a_row_stops_drafting_deep_where_no_draft_is_accepted_and_stays_exact(tiny_lm):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode("def quicksort(xs):")
    params = SamplingParams(max_tokens=160)
    plain = [e.id for e in generate(lm, prompt, params, SpecConfig("off")) if isinstance(e, Token)]
    policy = DepthPolicy(None, [0.8, 0.6, 0.4], pinned=3, per_row=True)  # as load_model gives "auto" alone
    spec = SpecConfig("mtp", 3, policy=policy)
    events = list(generate(lm, prompt, params, spec, drafter=replayed_drafter(lm, plain + [0] * 4,
                                                                                parse_profile("0,0,0"))))
    assert [e.id for e in events if isinstance(e, Token)] == plain
    # The row drafts one token a round at most once its own rounds outweigh the prior (on this tiny
    # model a depth-1 round costs about a plain one, so whether it parks is the clock's call).
    depths = [e.drafted for e in events if isinstance(e, Round)]
    assert max(depths[12:], default=0) <= 1 and sum(depths) < 0.4 * 3 * (len(plain) - 1)
    # Pinned, the same drafts run at depth 3 every round.
    pinned = list(generate(lm, prompt, params, SpecConfig("mtp", 3),
                           drafter=replayed_drafter(lm, plain + [0] * 4, parse_profile("0,0,0"))))
    assert [e.drafted for e in pinned if isinstance(e, Round)] == [3] * (len(plain) - 1)
