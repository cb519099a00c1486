"""A thinking budget is a rule on the token stream: plain decoding and drafting (serial and batched)
under the same budget give the same greedy tokens and the same sampled distribution, and a think
block never holds more than the budget plus the closing phrase."""

import dataclasses
import random

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2

from dyno_ui.paths import BUNDLED_MODEL
from helpers.distribution import FALSE_ALARM, chi_square, sample_tokens, target_dist
from speculative.batched import BatchSpeculator
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from helpers.drafts import drafted
from speculative.events import Token
from speculative.loader import load_checkpoint
from speculative.thinking_budget import CLOSING_PHRASE, BudgetProcessor, ThinkingBudget, budget_for


@pytest.fixture(scope="module")
def lm():
    return load_checkpoint(BUNDLED_MODEL)


def thinking_prompt(lm, content="def f(x):"):
    """A chat prompt whose template opens <think> (dyno-tiny thinks past 64 tokens after these)."""
    return list(lm.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=True, enable_thinking=True))


def tokens(lm, prompt, params, spec):
    return [e.id for e in generate(lm, prompt, params, spec) if isinstance(e, Token)]


# ---- the rule, against a plain state machine ----

def reference_forced(spec: ThinkingBudget, generated):
    """The token the rule forces after `generated` (-1: none), by walking the tokens one by one."""
    inside, count, tail = spec.open, 0, None  # tail: the phrase's next token after its </think>
    for t in generated:
        if tail is not None:
            tail = tail + 1 if tail + 1 < len(spec.phrase) else None
        elif inside:
            forced = count >= spec.budget
            count += 1
            if t == spec.end:
                inside = False
                j = count - 1 - spec.budget
                tail = j + 1 if forced and j + 1 < len(spec.phrase) else None
        elif t == spec.start:
            inside, count = True, 0
    if tail is not None:
        return spec.phrase[tail]
    return spec.phrase[count - spec.budget] if inside and count >= spec.budget else -1


def test_the_rule_is_the_state_machine():
    """Random streams of <think> (8), </think> (9) and text, the forced token taken whenever there is one."""
    rng = random.Random(0)
    start, end, vocab = 8, 9, 10
    for _ in range(150):
        phrase = tuple(rng.choices([1, 2, 3], k=rng.randint(0, 3))) + (end,) + tuple(rng.choices([1, 4], k=rng.randint(0, 2)))
        spec = ThinkingBudget(rng.choice([0, 1, 2, 4]), start, end, phrase, rng.random() < 0.5)
        processor = BudgetProcessor(spec)
        prompt = [0, 1]
        processor(mx.array(prompt), mx.zeros((1, vocab)))  # the first call is the prompt
        generated = []
        for _ in range(rng.randint(0, 24)):
            expected = reference_forced(spec, generated)
            out = processor(mx.array(prompt + generated), mx.zeros((1, vocab)))
            if expected >= 0:
                assert (out > -mx.inf).sum().item() == 1 and out[0, expected].item() == 0, (spec, generated)
                generated.append(expected)
            else:
                assert (out == 0).all().item(), (spec, generated)
                generated.append(rng.choice([start, end, start, end, 1, 2, 5, 6]))


def test_the_phrase_is_qwens(lm):
    spec = budget_for(lm, 8, thinking_prompt(lm))
    assert spec.open and spec.budget == 8
    assert lm.tokenizer.decode(list(spec.phrase)) == CLOSING_PHRASE
    assert spec.end == lm.tokenizer.think_end_tokens[0] and spec.end in spec.phrase
    assert not budget_for(lm, 8, thinking_prompt(lm)[:-2]).open  # before the template's <think>


# ---- greedy: drafting equals plain decoding under the budget ----

@pytest.mark.parametrize("budget", [0, 12])
def test_greedy_drafting_equals_plain_under_a_budget(lm, budget):
    prompt = thinking_prompt(lm)
    spec = budget_for(lm, budget, prompt)
    params = SamplingParams(max_tokens=64, thinking_budget=spec)
    plain = tokens(lm, prompt, params, SpecConfig("off"))
    for depth in (1, 3):
        assert tokens(lm, prompt, params, SpecConfig("mtp", depth)) == plain, depth
    free = tokens(lm, prompt, dataclasses.replace(params, thinking_budget=None), SpecConfig("off"))
    assert spec.end not in free  # unbudgeted, the model thinks past max_tokens
    close = plain.index(spec.end)
    assert close + 1 <= budget + len(spec.phrase)  # the think block: the model's tokens, then the phrase
    assert plain[:budget] == free[:budget] and plain[budget : budget + len(spec.phrase)] == list(spec.phrase)


def test_batched_rows_each_keep_their_own_budget(lm):
    """Rows with different budgets (and one without) drafting together: each is plain decoding of its own."""
    prompts = [thinking_prompt(lm), thinking_prompt(lm, "# Sort a list of numbers\ndef sort(xs):\n"),
               thinking_prompt(lm)]
    budgets = [5, 13, None]
    params = [SamplingParams(max_tokens=60, thinking_budget=None if b is None else budget_for(lm, b, p))
              for p, b in zip(prompts, budgets)]
    expected = [tokens(lm, p, q, SpecConfig("off")) for p, q in zip(prompts, params)]
    batch = BatchSpeculator(lm)
    got = {}
    for row, (p, q) in enumerate(zip(prompts, params)):
        got[row] = [e.id for e in batch.join(row, p, q).events if isinstance(e, Token)]
    depths = iter([3, 1, 0, 2] * 100)
    while len(batch):
        for row, out in batch.step(next(depths)).items():
            got[row] += [e.id for e in out.events if isinstance(e, Token)]
    assert [got[r] for r in range(3)] == expected
    end = lm.tokenizer.think_end_tokens[0]
    at = params[0].thinking_budget.phrase.index(end)
    assert [e.index(end) if end in e else None for e in expected] == [5 + at, 13 + at, None]


# ---- sampled: drafting has plain sampling's distribution under the budget ----

SAMPLED = SamplingParams(temperature=2.0, top_k=3)  # dyno-tiny is peaked: flattened, more outcomes are seen
SAMPLES = 400


def budget_joint(lm, prompt, spec, length):
    """P(first `length` tokens) under plain sampling with the budget: forced tokens certain, the
    others from mlx-lm's distribution, enumerated over the top-k supports."""
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in joint.items():
            forced = reference_forced(spec, seq)
            if forced >= 0:
                grown[seq + (forced,)] = p
                continue
            dist = target_dist(lm, prompt + list(seq), SAMPLED)
            for t in np.flatnonzero(dist):
                grown[seq + (int(t),)] = p * dist[t]
        joint = grown
    return joint


@pytest.mark.slow
def test_sampled_drafting_follows_plain_sampling_under_a_budget(lm):
    """Two free thinking tokens, the closing phrase, two free answer tokens: 81 outcomes, depth-3
    drafts crossing into the phrase and out of it. The phrase is cut to its end ("\n</think>\n\n")
    to keep the test short; the rule does not depend on its length."""
    tokenizer = lm.tokenizer
    start, end = tokenizer.think_start_tokens[0], tokenizer.think_end_tokens[0]
    prompt = tokenizer.encode("x = ") + [start]
    phrase = tuple(tokenizer.encode("\n</think>\n\n", add_special_tokens=False))
    spec = ThinkingBudget(2, start, end, phrase, open=True)
    length = spec.budget + len(phrase) + 2
    joint = budget_joint(lm, prompt, spec, length)
    counts = {}
    for seed in range(SAMPLES):
        params = dataclasses.replace(SAMPLED, max_tokens=length, seed=seed, thinking_budget=spec)
        out, _, _ = sample_tokens(drafted(lm, params, 3), prompt, length)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert set(counts) <= set(joint)  # nothing plain sampling under the budget never draws
    stat, dof = chi_square(counts, joint, SAMPLES)
    assert dof >= 8 and stat < chi2.isf(FALSE_ALARM, dof), (stat, dof)
