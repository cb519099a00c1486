"""Drafts copied from the context keep the output exact: greedy text is plain mlx-lm's token for token,
each copy round keeps exactly the drafts the greedy rule keeps, a seeded row is plain mlx-lm's seeded
text, alone or in a batch beside rows with other settings and sources; copied tokens say so."""

from pathlib import Path

import mlx.core as mx
import pytest

from engine.test_seeded import mlx_lm_seeded
from helpers.reference import plain_greedy_prefix
from speculative.batched import BatchSpeculator, Joiner
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.errors import DynoError
from speculative.events import Provenance, Round, Token
from speculative.heads.health import HeadHealth
from speculative.loader import load_checkpoint
from speculative.measure.suites import SUITES
from speculative.prompt_cache.store import PrefixCache
from speculative.round.copies import COPY_CAP, CopiesAndHead
from speculative.round.drafter import HeadDrafter
from speculative.stats import GenerationStats

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="row invariance holds on the CPU backend")

EDIT = SUITES["edit"][0]["prompt"]  # asks for two functions again, unchanged
SHORT = (4, 2)
LOOP = "def f(x):\n    return x\n" * 3  # tied-gqa2, random, soon repeats one token: its own output copies


@pytest.fixture(scope="module")
def bundled():
    return load_checkpoint(ROOT / "assets" / "dyno-tiny")


def run(lm, prompt, params, depth, copies, **kw):
    events = list(generate(lm, prompt, params, SpecConfig("mtp", depth, copies=copies), **kw))
    return [e for e in events if isinstance(e, Token)], events


def kept_by_the_rule(events, reference):
    """For each Round: (accepted, the leading drafts equal to `reference` at their positions)."""
    out, at = [], 0
    for e in events:
        if isinstance(e, Round):
            agree = 0
            while agree < e.drafted and e.drafts[agree] == reference[at + agree]:
                agree += 1
            out.append((e.accepted, agree))
        elif isinstance(e, Token):
            at += 1
    return out


@pytest.mark.parametrize("model, text, depth, copies", [
    ("bundled", EDIT, 3, "on"), ("bundled", EDIT, 1, "only"),
    ("tied-gqa2", LOOP, 2, "on"), ("tied-gqa2", LOOP, 4, "only")])
def test_copied_greedy_equals_mlx_lm(bundled, tiny_lm, model, text, depth, copies):
    lm = bundled if model == "bundled" else tiny_lm(model)
    prompt = lm.tokenizer.encode(text)
    n = 160
    # On the random model, 2-token matches too: more copies that break, to exercise the rejecting branch.
    drafter = CopiesAndHead(copies, sizes=SHORT) if model != "bundled" else None
    tokens, events = run(lm, prompt, SamplingParams(max_tokens=n), depth, copies, drafter=drafter)
    reference = plain_greedy_prefix(lm, prompt, n + COPY_CAP, stop_at_eos=False)
    assert [t.id for t in tokens] == plain_greedy_prefix(lm, prompt, n)
    # Every round, copied or drafted, keeps exactly its drafts the greedy rule agrees with.
    assert all(a == agree for a, agree in kept_by_the_rule(events, reference))
    rounds = [e for e in events if isinstance(e, Round)]
    copied = [r for r in rounds if r.source == "copy"]
    assert any(r.drafted > depth and r.accepted > depth for r in copied)  # deeper than the head, and kept
    assert any(r.accepted < r.drafted for r in copied)  # and the rejecting branch ran
    if copies == "only":
        assert all(r.source == "copy" for r in rounds)
    else:
        assert any(r.source == "head" for r in rounds)


def test_copied_tokens_have_their_own_provenance_and_counts(tiny_lm):
    lm = tiny_lm("tied-gqa2")
    tokens, events = run(lm, lm.tokenizer.encode(LOOP), SamplingParams(max_tokens=120), 3, "on")
    stats, source, kinds = GenerationStats(), None, {"head": [], "copy": []}
    for e in events:
        stats.add(e)
        if isinstance(e, Round):
            source = e.source
        elif isinstance(e, Token) and e.provenance.drafted:
            kinds[source].append(e.provenance)
    assert kinds["copy"] and set(kinds["copy"]) == {Provenance.COPY}
    assert set(kinds["head"]) <= {Provenance.DRAFT}
    assert Provenance.COPY.public == "draft"  # the two-label API still says "draft"
    copies = stats.sources["copy"]
    assert copies.accepted_tokens == len(kinds["copy"]) and stats.sources["head"].accepted_tokens == len(kinds["head"])
    assert copies.rounds + stats.sources["head"].rounds == stats.rounds
    assert stats.speculative_json()["by_source"]["copy"]["accepted_tokens"] == len(kinds["copy"])
    assert "copied" in stats.summary_line()


def test_off_is_the_head_alone(tiny_lm):
    lm = tiny_lm("tied-gqa2")
    prompt = lm.tokenizer.encode(LOOP)
    params = SamplingParams(max_tokens=60)
    off = run(lm, prompt, params, 3, "off")[1][:-1]  # (Done's timings aside)
    head = run(lm, prompt, params, 3, "on", drafter=HeadDrafter())[1][:-1]
    assert off == head and all(e.source == "head" for e in off if isinstance(e, Round))


def test_copy_rounds_do_not_judge_the_head():
    health = HeadHealth(window=2)  # a round with none kept judges its first draft
    for _ in range(2):
        assert not health.observe(Round(4, 0, (1, 2, 3, 4), confident=(True,) * 4, source="copy"))
    assert health.checking and health.drafted == 0
    for _ in range(2):
        health.observe(Round(4, 0, (1, 2, 3, 4), confident=(True,) * 4))
    assert health.collapsed


def test_a_resumed_prompt_copies_from_all_of_it(tiny_lm):
    """A second turn resumed from the prompt cache indexes its whole prompt (the cached part included):
    its copies come from the first turn too, and its text is plain greedy's."""
    lm = tiny_lm("tied-gqa2")
    cache = PrefixCache()
    first = lm.tokenizer.encode(LOOP)
    params = SamplingParams(max_tokens=40)
    tokens, _ = run(lm, first, params, 2, "on", prefix_cache=cache, drafter=CopiesAndHead("on", sizes=SHORT))
    second = first + [t.id for t in tokens] + lm.tokenizer.encode("\n" + LOOP)
    tokens, events = run(lm, second, params, 2, "on", prefix_cache=cache, drafter=CopiesAndHead("on", sizes=SHORT))
    done = events[-1]
    assert done.reused_prompt_tokens > 0
    assert [t.id for t in tokens] == plain_greedy_prefix(lm, second, 40)
    assert any(isinstance(e, Round) and e.source == "copy" and e.accepted for e in events)


def test_rows_with_other_settings_and_sources_in_one_batch(bundled):
    """Four rows: greedy with copies, greedy with the head alone, seeded sampled with copies, sampled
    with a penalty and copies alone, each joining with its own source, at depths that change each
    round (plain rounds included): greedy rows are plain greedy's text, the seeded row mlx-lm's seeded text."""
    lm = bundled
    prompt = lm.tokenizer.encode(EDIT)
    rows = {
        "copies": (SamplingParams(max_tokens=64), "on"),
        "head": (SamplingParams(max_tokens=48), "off"),
        "seeded": (SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=56), None),
        "penalty": (SamplingParams(temperature=1.0, repetition_penalty=1.2, max_tokens=40), "only"),
    }
    batch = BatchSpeculator(lm, drafter=CopiesAndHead("on"))
    out = {r: list(e.events) for r, e in batch.join_all(
        [Joiner(r, prompt, p, copies=c) for r, (p, c) in rows.items()]).items()}
    depths, i = [3, 1, 0, 2, 4], 0
    while batch:
        for r, got in batch.step(depths[i % 5], depths[(i + 1) % 5]).items():
            out[r] += got.events
        i += 1
    text = {r: [e.id for e in ev if isinstance(e, Token)] for r, ev in out.items()}
    assert text["copies"] == plain_greedy_prefix(lm, prompt, 64)
    assert text["head"] == plain_greedy_prefix(lm, prompt, 48)
    assert text["seeded"] == mlx_lm_seeded(lm, prompt, rows["seeded"][0])
    assert len(text["penalty"]) == 40 or text["penalty"][-1] in lm.eos_token_ids  # unseeded: it may draw EOS
    sources = {r: {e.source for e in ev if isinstance(e, Round)} for r, ev in out.items()}
    assert sources["head"] == {"head"} and sources["penalty"] <= {"copy"} and "copy" in sources["copies"]
    # Beside other rows a copy stays within the round's depth (alone it reaches deeper: above).
    assert all(e.drafted <= max(depths) for ev in out.values() for e in ev if isinstance(e, Round))


def test_a_bad_source_is_one_line():
    with pytest.raises(DynoError, match="--copies must be one of on, off, only"):
        SpecConfig(copies="sometimes")


def test_stats_and_metrics_by_source(tiny_lm):
    """/stats and /metrics count each source apart, from the same fold as the CLI's line."""
    from prometheus_client.parser import text_string_to_metric_families

    from dyno_ui.runtime.metrics import Outcome, ServerMetrics

    lm = tiny_lm("tied-gqa2")
    stats = GenerationStats()
    for e in run(lm, lm.tokenizer.encode(LOOP), SamplingParams(max_tokens=120), 3, "on")[1]:
        stats.add(e)
    metrics = ServerMetrics(3)
    metrics.record(Outcome(stats, "length", 10, 0, 1.0, 0.1))
    copy = metrics.stats_json()["speculative"]["by_source"]["copy"]
    assert copy["accepted_tokens"] == stats.sources["copy"].accepted_tokens > 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.exposition().decode()) for s in f.samples}
    assert samples[("mlx:draft_tokens_accepted_by_source_total", (("source", "copy"),))] == copy["accepted_tokens"]
    assert samples[("mlx:spec_decode_tokens_per_round_by_source", (("source", "copy"),))] == pytest.approx(
        copy["tokens_per_round"])
    assert samples[("mlx:draft_acceptance_by_source_position", (("position", "1"), ("source", "copy")))] == \
        pytest.approx(copy["acceptance_by_position"][0])


def test_the_playground_shows_copies_apart():
    from dyno_ui.playground import render
    from dyno_ui.playground.trace import Span

    assert 'tok tok-copy' in render.legend_html() and "copy" in render.KINDS
    html = render.token_spans([Span("return", "copy", "content", 0.0, 0), Span(" x", "draft", "content", 0.0, 1)])
    assert '<span class="tok tok-copy">return</span><span class="tok tok-draft"> x</span>' == html
    css = (ROOT / "assets" / "dyno.css").read_text()
    assert ".tok-copy {" in css and "--tok-copy:" in css
