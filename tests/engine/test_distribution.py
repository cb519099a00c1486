"""Speculative sampling has exactly the model's distribution (chi-square against exact references).

Every reference is built from mlx-lm's own sampling pieces in the model's dtype (generate_step's
log-softmax, make_sampler's filters, categorical_sampling's 1/temp), never from the engine's warp.
"""

import dataclasses
import itertools
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler
from scipy.stats import chi2, ncx2

from helpers import tiny_models
from helpers.distribution import (FALSE_ALARM, PARAMS, chi_square, exact_joint, image_target_dist, mlx_lm_probs,
                                  mlx_lm_scores, sample_tokens, target_dist, trunk_logits)
from speculative.config import SamplingParams
from helpers.drafts import drafted
from speculative.round.drafter import Drafts
from speculative.loader import load_checkpoint
from speculative.round.sampling import warp

pytestmark = pytest.mark.slow

# 2500 samples make a wrong rule visible (the shadow q below): accepting with 2p/q scores ~105 and
# drawing the correction from p instead of the residual ~111 on average, against a critical value of
# ~76 (27 cells): caught with probability 0.95 and 0.97 (noncentral chi-square over the wrong rules'
# exact joints; these seeds scored 105 and 81, the right rule 29). The earlier q, 0.3p + 0.6 uniform
# + 0.1 roll(p), needed 4000 samples and caught the residual error with probability 0.60 (~81).
DRAFT_VOCAB = 160  # of the tiny models' 320
SAMPLES = {"shadow": 2500, "mtp-head": 600, "draft-vocab": 600}


# ---- the warp is mlx-lm's sampling distribution, in the logits' dtype ----

def bf16(rows):
    return mx.array(rows, dtype=mx.float32).astype(mx.bfloat16)


# Rows where bf16 rounding decides the support (found by search over 1/16-step logits):
# min-p keeps token 0 only in bf16, top-p keeps token 1 only in float32, and the top-k pair
# 0 and 2**-7 ties at log-prob -8 in bf16, so top-k keeps token 1, not the larger token 2.
CRAFTED = [
    (bf16([[-0.625, 1.6875, -2.3125, -2.1875]]), SamplingParams(temperature=1.0, min_p=0.1)),
    (bf16([[3.3125, 1.0625, -1.875, -5.3125]]), SamplingParams(temperature=1.0, top_p=0.9)),
    (bf16([[8.0, 0.0, 2**-7, -30.0]]), SamplingParams(temperature=0.7, top_k=2)),
]
RANDOM = [
    (bf16(2 * np.random.default_rng(i).standard_normal((1, 320))), params)
    for i, params in enumerate([
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, top_k=40),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0.6, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=7),
    ])
]


@pytest.mark.parametrize("logits, params", CRAFTED + RANDOM)
def test_reference_is_what_mlx_lm_draws(logits, params):
    """mlx_lm_scores is exactly what make_sampler samples from: same global seed, same token."""
    sampler = make_sampler(params.temperature, params.top_p, params.min_p, top_k=params.top_k)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    scores = mlx_lm_scores(logits, params)
    for seed in range(64):
        mx.random.seed(seed)
        plain = sampler(logprobs)
        mx.random.seed(seed)
        assert plain.item() == mx.random.categorical(scores).item(), seed


@pytest.mark.parametrize("logits, params, crafted",
                         [c + (True,) for c in CRAFTED] + [c + (False,) for c in RANDOM])
def test_warp_is_mlx_lm_distribution(logits, params, crafted):
    """exp(warp) equals plain mlx-lm's distribution on bf16 rows; a float32-first warp does not."""
    expected = np.array(mlx_lm_probs(logits, params))
    got = np.array(mx.exp(warp(logits, params)))
    np.testing.assert_array_equal(got > 0, expected > 0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-9)
    old = np.array(mx.exp(warp(logits.astype(mx.float32), params)))  # the warp before this fix
    support = expected > 0
    if crafted:  # so this test can fail: the old warp gets even the support wrong
        assert (support != (old > 0)).any()
    else:  # and misses single probabilities by 0.4-4% (bf16(1/temp) and bf16 rounding of scores)
        assert (np.abs(old - expected)[support] / expected[support]).max() > 1e-3


def test_warp_treats_verify_rows_like_single_rows():
    """The target's [k + 1, V] verify rows warp exactly as plain decoding's [1, V] rows do."""
    rows = mx.concatenate([logits for logits, _ in RANDOM])  # [4, 320] bf16
    params = RANDOM[0][1]
    each = mx.concatenate([warp(rows[i : i + 1], params) for i in range(rows.shape[0])])
    assert mx.array_equal(warp(rows, params), each).item()


# ---- the first three tokens, against their exact joint (float32 model) ----

def shadow_q(p):
    support = (p > 0) / (p > 0).sum()
    return 0.8 * support + 0.2 * np.roll(p, 1)


class ShadowDrafter:
    """Drafts from q: uniform on p's support, plus some mass off it (every ratio p/q occurs); of the
    mixtures of p, uniform and roll(p), the one whose wrong rules stray furthest from p. Each row's p
    is its own (its context and sampling settings); a greedy row's drafts are drawn the same way."""

    def __init__(self, lm):
        self.lm = lm

    def dist(self, tokens, params):
        return target_dist(self.lm, tokens, params)

    def propose(self, rounds, budgets):
        k = max(budgets)
        tokens, probs = [], []
        for row, n in zip(rounds.rows, budgets):
            context = row.prompt + row.generated
            drafts, qs = [], []
            for _ in range(n):
                q = shadow_q(self.dist(context + drafts, row.params if not row.params.greedy else PARAMS))
                d = mx.random.categorical(mx.log(mx.array(q)), key=row.split()).item()
                drafts.append(d)
                qs.append(q)
            qs += [qs[-1] if qs else np.full(self.lm.vocab_size, 1 / self.lm.vocab_size)] * (k - n)  # past its length: unread
            tokens.append(drafts + [0] * (k - n))
            probs.append(None if row.params.greedy else mx.array(np.stack(qs).astype(np.float32)))
        return Drafts(mx.array(tokens, dtype=mx.uint32), probs, list(budgets))


# The real head's draft path once per projection: the full vocabulary (on the MoE model) and a draft
# subset (on the dense one); the dense model with its full vocabulary would repeat both.
@pytest.mark.parametrize("name, drafter", [("tied-gqa2", "shadow"), ("moe-fused", "mtp-head"),
                                           ("tied-gqa2", "draft-vocab")])
def test_first_tokens_follow_the_model(tiny_lm, name, drafter):
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode("x = ")
    joint = exact_joint(lm, prompt)
    counts, accepted = {}, 0
    n = SAMPLES[drafter]
    for seed in range(n):
        # Unseeded, so the lossless min(1, p/q) rule runs (a seed couples drafts by position instead:
        # test_six_tokens' seeded case); the engine's own key is drawn from `random`, seeded here.
        random.seed(seed)
        params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3)
        # draft-vocab: the head drafts from half the vocabulary; q is zero on the other half
        spec = drafted(lm, params, 2, draft_vocab=DRAFT_VOCAB if drafter == "draft-vocab" else None,
                       drafter=ShadowDrafter(lm) if drafter == "shadow" else None)
        tokens, _, acc = sample_tokens(spec, prompt, 3)
        accepted += acc
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    stat, dof = chi_square(counts, joint, n)
    assert stat < chi2.isf(FALSE_ALARM, dof), (stat, dof)
    if drafter == "shadow":
        assert accepted > 0.5 * n  # the accept branch was exercised, not only corrections


# ---- the same with an image in the prompt (tiny Qwen3.5-VL checkpoint) ----

# A short prompt (the trunk's recurrent layers step through a CPU prefill token by token): a 32x32
# image, 4 rows over 2 positions (rope delta -2), then text. What its sizes can see, as chi-square
# noncentrality per sample (critical values ~55-75): the image left out (its rows the pad token's
# embedding) 1.0, sequential positions 0.77, rows after the prompt without the delta 0.13. Finer
# position errors are the logits test's (test_vision.py).
VL_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>x = "
IMAGE_SAMPLES = {"shadow": 300, "mtp-head": 200}


class ImageShadowDrafter(ShadowDrafter):
    """The shadow drafter, its p the image prompt's (`vision`: its VisionInput)."""

    def __init__(self, lm, vision):
        super().__init__(lm)
        self.vision = vision

    def dist(self, tokens, params):
        return image_target_dist(self.lm, self.vision, tokens, params)


@pytest.fixture(scope="module")
def image_case(vl_dir):
    """The VL model, the prompt with its image's rows, its VisionInput, and the exact joint."""
    from helpers import vision_models
    from speculative.loader.vision import image_prompt

    lm = load_checkpoint(vl_dir)
    prompt, vision = image_prompt(lm.target, lm.vision, lm.tokenizer.encode(VL_PROMPT), [vision_models.png(32, 32)])
    assert vision.rope.delta == -2
    return lm, prompt, vision, exact_joint(lm, prompt, lambda lm, tokens: image_target_dist(lm, vision, tokens))


@pytest.mark.parametrize("drafter", ["shadow", "mtp-head"])
def test_first_tokens_with_an_image_follow_the_model(image_case, drafter):
    """Drafts, verify rows and corrections past an image's rows (at offset + rope delta) keep plain
    sampling's distribution, with the shadow drafter (every ratio p/q) and the real head."""
    lm, prompt, vision, joint = image_case
    counts, accepted, drafts = {}, 0, 0
    n = IMAGE_SAMPLES[drafter]
    for seed in range(n):
        random.seed(seed)  # the unseeded engine's own key: the lossless rule
        spec = drafted(lm, SamplingParams(temperature=1.0, top_k=3, max_tokens=3), 2,
                       drafter=ImageShadowDrafter(lm, vision) if drafter == "shadow" else None)
        tokens, d, acc = sample_tokens(spec, prompt, 3, vision)
        accepted, drafts = accepted + acc, drafts + d
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    stat, dof = chi_square(counts, joint, n)
    assert stat < chi2.isf(FALSE_ALARM, dof), (stat, dof)
    assert drafts >= n  # every sample drafted past the image
    if drafter == "shadow":
        assert accepted > 0.5 * n  # the accept branch was exercised, not only corrections


def wrong_step(p, q, rule):
    """A drafted token's distribution under a wrong rule: keeping it with min(1, 2p/q), or drawing the
    correction from p instead of normalize(max(p - q, 0))."""
    ratio = np.divide(p, q, out=np.zeros_like(p), where=q > 0)
    kept = q * np.minimum(1.0, (2.0 if rule == "2p/q" else 1.0) * ratio)
    residual = np.maximum(p - q, 0)
    return kept + (1 - kept.sum()) * (p if rule == "from-p" else residual / residual.sum())


@pytest.mark.parametrize("rule", ["2p/q", "from-p"])
def test_the_shadow_samples_catch_the_wrong_rules(tiny_lm, rule):
    """SAMPLES["shadow"] suffices: the shadow test fails a wrong rule with probability >= 0.9 (0.95 and
    0.97 now), by the noncentral chi-square over chi_square's cells of the rule's exact joint. Each
    token after the first is one drafted step: a round's second draft is judged given the first."""
    lm = tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode("x = ")
    joint, n = exact_joint(lm, prompt), SAMPLES["shadow"]

    def step(context):
        p = target_dist(lm, context)
        return wrong_step(p, shadow_q(p), rule)

    p1 = target_dist(lm, prompt)
    wrong = {(a, b, c): p1[a] * step(prompt + [a])[b] * step(prompt + [a, b])[c] for a, b, c in joint}
    big = [c for c, p in joint.items() if p * n >= 5]
    right, got = [joint[c] for c in big], [wrong[c] for c in big]
    if (1 - sum(right)) * n >= 5:  # the pooled cell, as chi_square makes it
        right, got = right + [1 - sum(right)], got + [1 - sum(got)]
    right, got = np.array(right), np.array(got)
    noncentrality, dof = n * ((got - right) ** 2 / right).sum(), len(right) - 1
    assert ncx2.sf(chi2.isf(FALSE_ALARM, dof), dof, noncentrality) >= 0.9, (noncentrality, dof)


# ---- six tokens over several rounds: bf16 and quantized models, filters and processors ----

# Logits scaled 3x (top token 15-50%, as in trained models) so the filters cut real mass. The
# bias's float32 values promote bf16 rows to float32 in mlx-lm (and so in the warp); the q4
# setting stays bf16 throughout. At these sizes a token outside plain decoding's support fails at once (verify rows processed
# without the drafts as history: 17 such tokens; rollback one token short: hundreds), and the
# chi-square catches gross errors (no processors on verify rows: 839 against 96), not subtle
# rule errors: 2p/q acceptance scored 52 against 96; the shadow test above is for those.
SETTINGS = {  # name: (draft depth, samples, params); quantized matmuls are slow on CPU
    "bf16": (2, 200, SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05, top_k=5, logit_bias={32: 1.5},
                                    presence_penalty=0.5)),
    "q4": (3, 150, SamplingParams(temperature=0.8, top_p=0.85, min_p=0.08, top_k=4, repetition_penalty=1.3)),
}
LONG_TOKENS = 6
DRAFT_NOISE = 1.0  # q differs from p enough that rejections and residual draws are common


class TrunkDrafter:
    """Drafts through the engine's own processors and warp (Row.pick) from the trunk's logits for
    the next position plus noise in the model's dtype, reused for every draft of the round: the
    first draft is often kept, later ones often corrected (the random head's are almost never kept).
    Only committed prefixes are forwarded, the same ones the reference needs. Sampled rows only."""

    def __init__(self, lm):
        self.lm = lm

    def propose(self, rounds, budgets):
        tokens, probs = [], []
        for row, k in zip(rounds.rows, budgets):
            history = row.history() if row.processors else None
            base = trunk_logits(self.lm, row.prompt + row.generated)
            drafts, qs = [], []
            for j in range(k):
                noise = DRAFT_NOISE * mx.random.normal(base.shape, key=row.split())
                logits = base + noise.astype(base.dtype)
                if history is not None:
                    logits = row.processors.row(logits, history, mx.concatenate(drafts) if drafts else None)
                d, q = row.pick(logits, j)
                drafts.append(d)
                qs.append(q)
            tokens.append(mx.concatenate(drafts))
            probs.append(mx.concatenate(qs))
        return Drafts(mx.stack(tokens), probs, list(budgets))


@pytest.fixture(scope="module")
def low_precision_lm(tiny_dir, tmp_path_factory):
    """A bf16 tied-gqa2 checkpoint, and its 4-bit (group 32) conversion with the head beside it."""
    source = tiny_dir("tied-gqa2", dtype=mx.bfloat16, logit_scale=3.0)
    model, head = tiny_models.quantized(source, tmp_path_factory.mktemp("q4"))
    models = {"bf16": load_checkpoint(source), "q4": load_checkpoint(model, mode="mtp", mtp_head=str(head))}
    return models.__getitem__


def step_statistic(rows, observed, contexts):
    """Chi-square of one step's tokens against their conditionals; returns (stat, dof).

    rows[s] is sample s's exact next-token distribution given its own prefix, contexts[s] that
    prefix. Cells are (context, token) pairs expected at least 5 times, the rest pooled: per
    context this is the Pearson test of the conditional (Anderson & Goodman's test for chains,
    whose per-step statistics add up). Observed minus expected cell counts is a sum of
    martingale differences with covariance sum(diag(p) - p p^T), so the quadratic form is
    chi-square with that matrix's rank as dof, even where contexts have few samples.
    """
    index = {}
    group = np.array([index.setdefault(c, len(index)) for c in contexts])  # [S] context number
    expected = np.zeros((group.max() + 1, rows.shape[1]))
    np.add.at(expected, group, rows)
    cell = np.where(expected >= 5, np.cumsum(expected >= 5).reshape(expected.shape) - 1, -1)
    pool = int((expected >= 5).sum())
    if pool == 0:
        return 0.0, 0
    cell[cell < 0] = pool
    if expected[cell == pool].sum() < 5:
        cell[cell == pool] = pool - 1  # too small to stand alone: join the last cell
    cells = cell.max() + 1
    by_sample = cell[group]  # [S, V] cell of each token for each sample
    p = np.zeros((len(rows), cells))
    np.add.at(p, (np.repeat(np.arange(len(rows)), rows.shape[1]), by_sample.ravel()), rows.ravel())
    o = np.eye(cells)[by_sample[np.arange(len(rows)), observed]]
    d = (o - p).sum(axis=0)
    # Singular (rows sum to 1; a token certain in every row varies not at all): invert on its range.
    w, v = np.linalg.eigh(np.diag(p.sum(axis=0)) - p.T @ p)
    live = w > 1e-9 * w.max()
    return float(((v[:, live].T @ d) ** 2 / w[live]).sum()), int(live.sum())


@pytest.mark.parametrize("setting, rule", [("bf16", "lossless"), ("q4", "lossless"), ("bf16", "seeded")])
def test_six_tokens_follow_the_model(low_precision_lm, setting, rule):
    """Unseeded requests take the lossless rule; seeded ones, over many seeds, plain mlx-lm's draws
    with the drafts coupled by position (sampling.seeded_pick): both follow the model."""
    depth, n, base = SETTINGS[setting]
    lm = low_precision_lm(setting)
    prompt = lm.tokenizer.encode("x = ")
    samples, n_drafted, accepted = [], 0, 0
    for seed in range(n):
        random.seed(seed)  # the unseeded engine's own key
        params = dataclasses.replace(base, seed=seed if rule == "seeded" else None, max_tokens=LONG_TOKENS)
        spec = drafted(lm, params, depth, drafter=TrunkDrafter(lm))
        tokens, d, a = sample_tokens(spec, prompt, LONG_TOKENS)
        samples.append(tokens)
        n_drafted, accepted = n_drafted + d, accepted + a
    total, dof = 0.0, 0
    for j in range(LONG_TOKENS):
        rows = np.stack([target_dist(lm, prompt + s[:j], base) for s in samples])
        observed = np.array([s[j] for s in samples])
        drawable = rows[np.arange(len(samples)), observed] > 0
        assert drawable.all(), f"step {j + 1}: a token plain decoding never draws"
        stat, cells = step_statistic(rows, observed, [tuple(s[:j]) for s in samples])
        total, dof = total + stat, dof + cells
    assert dof >= 10 and total < chi2.isf(FALSE_ALARM, dof), (total, dof)
    assert 0.1 * n_drafted < accepted < 0.9 * n_drafted  # both branches ran, over several rounds each


def test_seeded_runs_are_reproducible(tiny_lm):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode("x = ")
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=7)

    def run():
        steps = drafted(lm, params, 3).run(prompt)
        return [e.id for e in itertools.islice((e for e in steps if hasattr(e, "id")), 40)]

    assert run() == run()
