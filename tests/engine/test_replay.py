"""Replayed acceptance: scripted drafts keep the output plain greedy's and hit the profile."""

import math

import pytest

from speculative.config import SamplingParams, SpecConfig
from speculative.errors import DynoError
from speculative.measure.bench import run_dyno, run_mlx_lm
from speculative.measure.replay import ContextProfile, ReplayedDrafter, Script, parse_profile, replayed_drafter

PROMPT = [5, 17, 101, 42, 7]


@pytest.mark.parametrize("depth,profile", [(3, (0.93, 0.86, 0.75)), (2, (0.5, 0.2))])
def test_replay_is_exact_and_follows_the_profile(tiny_lm, depth, profile):
    lm = tiny_lm("tied-gqa2")
    n = 240
    reference = run_mlx_lm(lm, PROMPT, SamplingParams(max_tokens=n + depth)).tokens
    run = run_dyno(lm, PROMPT, SamplingParams(max_tokens=n), SpecConfig("mtp", depth, None),
                   drafter=replayed_drafter(lm, reference, profile, seed=1))
    assert run.tokens == reference[:n]
    drafted = run.stats.drafted_per_position
    for p, got, rounds in zip(profile, run.stats.acceptance_by_position(), drafted):
        assert abs(got - p) <= 4 * math.sqrt(p * (1 - p) / rounds) + 1e-9, (profile, run.stats.acceptance_by_position())


def test_profiles_are_checked():
    assert parse_profile("27b-code") == (0.93, 0.86, 0.75)
    assert parse_profile("0.9,0.5") == (0.9, 0.5)
    for bad in ("0.5,0.9", "1.2", "x"):
        with pytest.raises(DynoError):
            parse_profile(bad)


@pytest.mark.parametrize("ids", ["first", "seeded"])
def test_replay_over_a_draft_vocabulary_drafts_from_it(tiny_lm, ids):
    """The head projects onto the subset's rows only and every draft is one of its ids; output stays greedy's."""
    from speculative.draft_vocab.head import DraftLMHead, lm_head_module
    from tools.standin.scale import draft_subset

    lm = tiny_lm("tied-gqa2")
    n, depth = 60, 3
    reference = run_mlx_lm(lm, PROMPT, SamplingParams(max_tokens=n + depth)).tokens
    vocab = lm.target.args.vocab_size
    subset = draft_subset(lm.tokenizer, vocab, 96, first=reference, ids=ids, seed=3)
    assert len(subset) == 96 and set(reference) <= set(subset)
    head = DraftLMHead(lm_head_module(lm.target), subset, vocab)
    drafted, projections = [], []

    class Recording(ReplayedDrafter):
        def propose(self, rounds, budgets):
            out = super().propose(rounds, budgets)
            drafted.extend(out.tokens[0].tolist())
            return out

    greedy = head.greedy  # the subset's greedy draft step: counted, to show the drafts go through it
    head.greedy = lambda hidden: projections.append(hidden.shape) or greedy(hidden)
    drafter = Recording({None: reference}, (0.9, 0.7, 0.5), lm.vocab_size, seed=1, draft_head=head, row_seeds=False)
    run = run_dyno(lm, PROMPT, SamplingParams(max_tokens=n), SpecConfig("mtp", depth, None), drafter=drafter)
    assert run.tokens == reference[:n]
    assert projections  # the draft step projected through the subset's rows
    assert drafted and set(drafted) <= set(subset)
    assert run.stats.acceptance_by_position()[0] > 0.5  # the subset holds the reference: right drafts are drafted


def test_a_replayed_batch_is_exact_and_follows_the_profile_on_every_row(tiny_lm):
    """Three rows, each scripted against its own plain greedy tokens: every row's text is its reference,
    and the batch's rounds accept at the profile's rates."""
    from speculative.events import Round, Token
    from speculative.measure.replay import replayed_batch

    lm = tiny_lm("tied-gqa2")
    n, depth, profile = 120, 3, (0.9, 0.7, 0.5)
    prompts = {i: PROMPT[i:] + [i + 3] for i in range(3)}
    references = {i: run_mlx_lm(lm, p, SamplingParams(max_tokens=n + depth)).tokens for i, p in prompts.items()}
    batch = replayed_batch(lm, references, profile, seed=1)
    got = {i: [e.id for e in batch.join(i, p, SamplingParams(max_tokens=n)).events] for i, p in prompts.items()}
    drafted, accepted = [0] * depth, [0] * depth
    while batch:
        for i, out in batch.step(depth).items():
            got[i] += [e.id for e in out.events if isinstance(e, Token)]
            for r in (e for e in out.events if isinstance(e, Round)):
                for j in range(r.drafted):
                    drafted[j] += 1
                    accepted[j] += j < r.accepted
    assert got == {i: ref[:n] for i, ref in references.items()}
    for p, a, d in zip(profile, accepted, drafted):
        assert abs(a / d - p) <= 4 * math.sqrt(p * (1 - p) / d), (accepted, drafted)
    with pytest.raises(DynoError, match="greedy"):
        batch.join(9, PROMPT, SamplingParams(max_tokens=4, temperature=0.7))


def test_a_context_profile_interpolates_between_its_points_and_clamps_beyond():
    profile = parse_profile("1k:0.9,0.8,0.6/3072:0.5,0.4,0.2", by_context=True)
    assert isinstance(profile, ContextProfile) and len(profile) == 3
    assert profile.at(1024) == (0.9, 0.8, 0.6) and profile.at(3072) == (0.5, 0.4, 0.2)
    assert profile.at(10) == (0.9, 0.8, 0.6) and profile.at(10**6) == (0.5, 0.4, 0.2)
    assert all(math.isclose(a, b) for a, b in zip(profile.at(2048), (0.7, 0.6, 0.4)))
    assert all(math.isclose(a, b) for a, b in zip(profile.at(1536), (0.8, 0.7, 0.5)))
    long = parse_profile("27b-long", by_context=True)  # vLLM #47602's position-1 decay
    assert long.at(1024)[0] == 0.935 and long.at(32768)[0] == 0.721
    assert long.at(1024) == (0.935, 0.86, 0.75)


@pytest.mark.parametrize("bad, message", [
    ("1k:0.9,0.8/512:0.5,0.4", "a context profile's contexts must increase"),
    ("1k:0.9,0.8/2k:0.5", "every point of a context profile needs as many positions"),
    ("lots:0.9", "a profile point's context must be a number of tokens"),
    ("1k:0.5,0.9", "acceptance rates must be non-increasing"),
    ("1k:0.9/2k", "every point of a context profile is CONTEXT:RATES"),
])
def test_context_profiles_are_checked(bad, message):
    with pytest.raises(DynoError) as e:
        parse_profile(bad, by_context=True)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(DynoError, match="not a profile by context"):  # where rates by position are taken
        parse_profile("27b-long")


def within(got, p, n):
    """`got` is a frequency over n draws of a probability p, within four standard errors."""
    return abs(got - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-9


def test_scripted_acceptance_follows_the_profile_at_each_context():
    """Over many rounds at one context, position j is right as often as the interpolated rate says."""
    profile = parse_profile("1k:0.9,0.8,0.6/3072:0.3,0.2,0.1", by_context=True)
    reference, n = list(range(1, 4001)), 3000
    script = Script(reference, profile, vocab=5000, seed=2)
    for context in (512, 1536, 2048, 4096):
        right = [0, 0, 0]
        for start in range(n):
            drafts = script.drafts(start, 3, context)
            for j in range(3):
                right[j] += all(d == reference[start + i] for i, d in enumerate(drafts[: j + 1]))
        assert all(within(r / n, p, n) for r, p in zip(right, profile.at(context))), (context, right)


def test_a_rows_context_picks_its_rates(tiny_lm):
    """Replayed runs from a short and a long prompt under one context profile: each accepts at the
    rates of its own context (the profile's two ends here), output plain greedy's."""
    lm = tiny_lm("tied-gqa2")
    profile = parse_profile("300:0.9,0.8,0.6/700:0.3,0.15,0.05", by_context=True)
    n = 240
    for prompt, rates in ((PROMPT, profile.at(0)), ((PROMPT * 160)[:800], profile.at(10**6))):
        reference = run_mlx_lm(lm, prompt, SamplingParams(max_tokens=n + 3)).tokens
        run = run_dyno(lm, prompt, SamplingParams(max_tokens=n), SpecConfig("mtp", 3, None),
                       drafter=replayed_drafter(lm, reference, profile, seed=1))
        assert run.tokens == reference[:n]
        got = run.stats.acceptance_by_position()
        assert all(within(g, p, r) for g, p, r in zip(got, rates, run.stats.drafted_per_position)), (rates, got)
