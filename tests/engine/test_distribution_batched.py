"""Speculative sampling keeps the model's distribution at width 2 and 4: sampled rows beside greedy and
seeded rows in one batch, every row drafted by an adversarial drafter through the one drafter seam.

The sampled rows' first three tokens are tested against their exact joint (chi-square), with a power
check for each drafter's sample count; the greedy row must be plain greedy's text and the seeded row
plain mlx-lm's seeded text in every run, whatever the rows beside them draw.
"""

import random
import zlib

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2, ncx2

from engine.test_distribution import ShadowDrafter, wrong_step
from helpers.distribution import FALSE_ALARM, PARAMS, PastEos, chi_square, exact_joint, target_dist
from speculative.batched import BatchSpeculator, Joiner
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Round, Token
from speculative.round.drafter import Drafts, one_hot

pytestmark = pytest.mark.slow

PROMPT = "x = "
GREEDY = SamplingParams(max_tokens=3)
ROWS = {2: ("sampled", "seeded"), 4: ("sampled", "greedy", "sampled", "seeded")}
# Sampled-row samples per drafter: the shadow's, as at width 1 (test_distribution.SAMPLES); the coin's,
# what test_the_coin_samples_catch_the_wrong_rules shows is enough.
SAMPLES = {"shadow": 2500, "coin": 1200}
SEEDED_CHECKS = 40  # runs whose seeded row is held against plain mlx-lm's own seeded text


def coin_token(p: np.ndarray, context) -> int:
    """A token chosen from the context alone (so a one-hot q is its true draft distribution): by a
    hash of the context, p's likeliest token, its least likely one in the support, or one outside it."""
    support = np.flatnonzero(p)
    pick = zlib.crc32(np.asarray(context, dtype=np.int64).tobytes()) % 3
    if pick == 0:
        return int(np.argmax(p))
    if pick == 1:
        return int(support[np.argmin(p[support])])
    return int(np.flatnonzero(p == 0)[0])


class CoinDrafter:
    """Proposes likely and unlikely tokens on purpose, each with certainty (one-hot q): the lossless
    rule then keeps draft x with probability p(x) and otherwise draws from p with x removed."""

    def __init__(self, lm):
        self.lm = lm

    def propose(self, rounds, budgets):
        k = max(budgets)
        tokens, probs = [], []
        for row, n in zip(rounds.rows, budgets):
            context = row.prompt + row.generated
            drafts = []
            for _ in range(n):
                drafts.append(coin_token(target_dist(self.lm, context + drafts, sampled_params(row.params)), context + drafts))
            padded = drafts + [0] * (k - n)
            tokens.append(padded)
            probs.append(None if row.params.greedy else one_hot(padded, self.lm.vocab_size))
        return Drafts(mx.array(tokens, dtype=mx.uint32), probs, list(budgets))


def sampled_params(params):
    """The distribution a drafter proposes from: the row's own warp, PARAMS' for a greedy row."""
    return PARAMS if params.greedy else params


def row_params(kind: str, run: int) -> SamplingParams:
    return {"sampled": PARAMS, "greedy": GREEDY, "seeded": SamplingParams(temperature=1.0, top_k=3, max_tokens=3,
                                                                           seed=run)}[kind]


def plain_text(lm, prompt, params):
    """Plain mlx-lm's tokens (generate_step through Dyno's plain path), up to 3, stopping at EOS."""
    return [e.id for e in generate(lm, prompt, params, SpecConfig("off")) if isinstance(e, Token)]


def batched_samples(lm, prompt, drafter, kinds, runs, depth=2):
    """Each run one batch of rows of `kinds`, past EOS; returns the sampled rows' token triples, how
    many drafts they made and kept, and whether the greedy and seeded rows were plain mlx-lm's."""
    greedy = plain_text(lm, prompt, GREEDY)
    samples, drafted, accepted = [], 0, 0
    for run in range(runs):
        random.seed(run)  # the unseeded rows' own keys
        batch = BatchSpeculator(PastEos(lm), keep_states=False, drafter=drafter)
        joined = batch.join_all([Joiner(b, prompt, row_params(kind, run)) for b, kind in enumerate(kinds)])
        tokens = {b: [e.id for e in out.events if isinstance(e, Token)] for b, out in joined.items()}
        while batch:
            for b, out in batch.step(depth).items():
                tokens[b] += [e.id for e in out.events if isinstance(e, Token)]
                for r in (e for e in out.events if isinstance(e, Round)):
                    if kinds[b] == "sampled":
                        drafted, accepted = drafted + r.drafted, accepted + r.accepted
        for b, kind in enumerate(kinds):
            if kind == "sampled":
                samples.append(tuple(tokens[b]))
            elif kind == "greedy":
                assert tokens[b][: len(greedy)] == greedy, run
            elif run < SEEDED_CHECKS:
                want = plain_text(lm, prompt, row_params(kind, run))
                assert tokens[b][: len(want)] == want, run
    return samples, drafted, accepted


# The shadow at width 2 would take 2500 batches (one sampled row each): width 1 (test_distribution.py)
# and width 4 bracket it.
@pytest.mark.parametrize("width, drafter", [(2, "coin"), (4, "coin"), (4, "shadow")])
def test_sampled_rows_follow_the_model_beside_other_rows(tiny_lm, width, drafter):
    lm = tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode(PROMPT)
    kinds = ROWS[width]
    runs = -(-SAMPLES[drafter] // kinds.count("sampled"))
    make = ShadowDrafter if drafter == "shadow" else CoinDrafter
    samples, drafted, accepted = batched_samples(lm, prompt, make(lm), kinds, runs)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    joint = exact_joint(lm, prompt)
    assert set(counts) <= set(joint)  # never a token plain sampling cannot draw
    stat, dof = chi_square(counts, joint, len(samples))
    assert stat < chi2.isf(FALSE_ALARM, dof), (stat, dof)
    assert 0.1 * drafted < accepted < 0.9 * drafted  # the accept and the residual branches both ran


@pytest.mark.parametrize("rule", ["2p/q", "from-p"])
def test_the_coin_samples_catch_the_wrong_rules(tiny_lm, rule):
    """SAMPLES["coin"] suffices: the test above fails a wrong rule with probability >= 0.9, by the
    noncentral chi-square over chi_square's cells of the rule's exact joint (as the shadow's check in
    test_distribution.py); each token after the first is one drafted step, its q one-hot."""
    lm = tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode(PROMPT)
    joint, n = exact_joint(lm, prompt), SAMPLES["coin"]

    def step(context):
        p = target_dist(lm, context)
        q = np.zeros_like(p)
        q[coin_token(p, context)] = 1.0
        return wrong_step(p, q, rule)

    p1 = target_dist(lm, prompt)
    wrong = {(a, b, c): p1[a] * step(prompt + [a])[b] * step(prompt + [a, b])[c] for a, b, c in joint}
    big = [c for c, p in joint.items() if p * n >= 5]
    right, got = [joint[c] for c in big], [wrong[c] for c in big]
    if (1 - sum(right)) * n >= 5:
        right, got = right + [1 - sum(right)], got + [1 - sum(got)]
    right, got = np.array(right), np.array(got)
    noncentrality, dof = n * ((got - right) ** 2 / right).sum(), len(right) - 1
    assert ncx2.sf(chi2.isf(FALSE_ALARM, dof), dof, noncentrality) >= 0.9, (noncentrality, dof)

