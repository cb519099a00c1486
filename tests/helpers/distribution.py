"""Exact references for the distribution tests: plain mlx-lm's next-token distributions built from
mlx-lm's own sampling pieces, exact joints over short continuations, and the chi-square statistic."""

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from speculative.config import SamplingParams
from speculative.events import Token


PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=3)


# A correct engine exceeds the critical value with probability 1e-6.
FALSE_ALARM = 1e-6


def mlx_lm_scores(logits: mx.array, params: SamplingParams) -> mx.array:
    """What plain mlx-lm hands mx.random.categorical for a [1, V] row, in the row's dtype."""
    logprobs = logits - mx.logsumexp(logits, keepdims=True)  # generate_step
    if 0 < params.top_p < 1.0:  # make_sampler's chain, in its order
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)  # categorical_sampling


def mlx_lm_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution plain mlx-lm draws from: categorical adds float32 Gumbel noise to the scores."""
    return mx.softmax(mlx_lm_scores(logits, params).astype(mx.float32), axis=-1)


def mlx_lm_processors(params: SamplingParams):
    """mlx-lm's logits processors for these parameters, built directly (not through the engine)."""
    return make_logits_processors(
        dict(params.logit_bias) if params.logit_bias else None, params.repetition_penalty,
        params.repetition_context_size, params.presence_penalty, params.presence_context_size,
        params.frequency_penalty, params.frequency_context_size)


_memo = {}


def trunk_logits(lm, tokens):
    """[1, V] next-token logits after `tokens` by a fresh trunk forward (no cache), model dtype; memoised."""
    key = (id(lm), tuple(tokens))
    if key not in _memo:
        _memo[key] = lm.model(mx.array(tokens)[None])[:, -1]
    return _memo[key]


def target_dist(lm, tokens, params=PARAMS):
    """Plain decoding's next-token distribution after `tokens`: mlx-lm's processors over every
    token (as generate_step passes them) on a fresh forward's logits, then mlx_lm_probs; memoised."""
    key = (id(lm), params, tuple(tokens))
    if key not in _memo:
        logits = trunk_logits(lm, tokens)
        for processor in mlx_lm_processors(params):
            logits = processor(mx.array(tokens), logits)
        _memo[key] = np.array(mlx_lm_probs(logits, params)[0])
    return _memo[key]


def image_target_dist(lm, vision, prompt, params=PARAMS):
    """target_dist for a prompt that starts with an image prompt (`vision`: its VisionInput, for its
    first rows): a fresh, uncached forward of the whole of `prompt`, the image prompt's rows at their
    embeddings and M-RoPE positions, every later row at its index + rope delta; memoised."""
    key = (id(lm), id(vision), params, tuple(prompt))
    if key not in _memo:
        n = vision.embeddings.shape[1]
        tail = lm.target.embed(mx.array(prompt[n:])[None]) if len(prompt) > n else None
        embeddings = vision.embeddings if tail is None else mx.concatenate([vision.embeddings, tail], axis=1)
        trunk = lm.target.positioned(vision.rope)
        logits = trunk(mx.array(prompt)[None], lm.target.make_cache(), embeddings)[:, -1]
        for processor in mlx_lm_processors(params):
            logits = processor(mx.array(prompt), logits)
        _memo[key] = np.array(mlx_lm_probs(logits, params)[0])
    return _memo[key]


def exact_joint(lm, prompt, dist=None):
    """P(t1, t2, t3) under plain sampling, enumerated over the top-k supports; `dist(lm, tokens)` the
    next-token distribution (target_dist unless given)."""
    dist = dist or target_dist
    joint = {}
    p1 = dist(lm, prompt)
    for a in np.flatnonzero(p1):
        p2 = dist(lm, prompt + [int(a)])
        for b in np.flatnonzero(p2):
            p3 = dist(lm, prompt + [int(a), int(b)])
            for c in np.flatnonzero(p3):
                joint[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]
    return joint


def chi_square(counts, joint, n):
    """Pearson statistic over cells with expectation >= 5, the rest pooled; returns (stat, dof)."""
    big = {c: p for c, p in joint.items() if p * n >= 5}
    observed = [counts.get(c, 0) for c in big]
    expected = [p * n for p in big.values()]
    rest_obs = n - sum(observed)
    rest_exp = n - sum(expected)
    if rest_exp >= 5:
        observed.append(rest_obs)
        expected.append(rest_exp)
    else:
        assert rest_obs <= max(5, 3 * rest_exp), "mass where the model puts almost none"
    obs, exp = np.array(observed), np.array(expected)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


class PastEos:
    """A LoadedModel whose generations go on past EOS, as the exact references do."""

    eos_token_ids = frozenset()

    def __init__(self, lm):
        self._lm = lm

    def __getattr__(self, name):
        return getattr(self._lm, name)


def sample_tokens(spec, prompt, n, vision=None):
    """The first n tokens a speculative run (helpers.drafts.OneRow) emits after `prompt` (with `vision`:
    its images), past EOS, and how many drafts it made and kept."""
    spec.batch.lm = PastEos(spec.batch.lm)
    tokens, drafted, accepted = [], 0, 0
    for e in (spec.run(prompt) if vision is None else spec.run(prompt, vision=vision)):
        if isinstance(e, Token):
            tokens.append(e.id)
        else:
            drafted, accepted = drafted + e.drafted, accepted + e.accepted
        if len(tokens) == n:
            return tokens, drafted, accepted
