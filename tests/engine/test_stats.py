"""One event stream, one figure everywhere: tokens per round and acceptance by position as the CLI
line, the JSON, /stats, /metrics, the playground's Trace and the bench report them."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from speculative.measure import bench
from speculative.measure.bench import Run, paired_benchmark
from speculative.config import SamplingParams
from speculative.events import Done, Provenance, Round, Token
from speculative.stats import GenerationStats
from dyno_ui.cli.bench import _aggregate
from dyno_ui.playground import charts, render
from dyno_ui.playground.trace import Trace
from dyno_ui.runtime.metrics import Outcome, ServerMetrics
from dyno_ui.runtime.outputs import Finished, Traced

D, C, B = Provenance.DRAFT, Provenance.CORRECTION, Provenance.BONUS


def stream():
    """The prefill's token, then rounds of depth 3, 3, 2, 1 and 3; a stop cuts the last after two drafts."""
    rounds = [(Round(3, 2), [D, D, C]), (Round(3, 3), [D, D, D, B]), (Round(2, 0), [C]),
              (Round(1, 1), [D, B]), (Round(3, 3), [D, D])]
    events = [Token(1, Provenance.PLAIN)]
    for r, kinds in rounds:
        events += [r] + [Token(2, k) for k in kinds]
    return events + [Done("stop", 4, 13, 0.1, 1.2)]


# Hand-computed: 5 rounds, 3 + 3 + 2 + 1 + 3 = 12 drafts, 2 + 3 + 0 + 1 + 2 = 8 delivered.
TOKENS_PER_ROUND = 1 + 8 / 5
ACCEPTED = [4, 3, 1]  # position 1: all but the depth-2 round; 2: rounds 1, 2, 5; 3: round 2
DRAFTED = [5, 4, 3]  # rounds at least 1, 2 and 3 deep
ACCEPTANCE = [4 / 5, 3 / 4, 1 / 3]


def folded(events) -> GenerationStats:
    stats = GenerationStats(draft_depth=3)
    for e in events:
        stats.add(e)
    return stats


def test_the_stats_own_both_figures():
    stats = folded(stream())
    assert (len(stats.tokens), stats.rounds, stats.draft_tokens, stats.accepted_tokens) == (13, 5, 12, 8)
    assert stats.tokens_per_round == pytest.approx(TOKENS_PER_ROUND)
    assert stats.accepted_per_position == ACCEPTED and stats.drafted_per_position == DRAFTED
    assert stats.acceptance_by_position() == pytest.approx(ACCEPTANCE)
    assert stats.summary_line() == "MTP: 13 tokens in 5 rounds (2.60 per round), 8/12 drafts accepted"
    spec = stats.speculative_json()
    assert spec["tokens_per_round"] == pytest.approx(TOKENS_PER_ROUND)
    assert spec["acceptance_by_position"] == pytest.approx(ACCEPTANCE)
    assert spec["accepted_per_position"] == ACCEPTED and spec["drafted_per_position"] == DRAFTED


def test_merge_and_counts_give_the_figures_of_the_whole_stream():
    events = stream()
    cut = events.index(Round(2, 0))  # the first two rounds (depth 3) in one, the rest in the other
    whole = GenerationStats()
    whole.merge(folded(events[:cut]))
    whole.merge(folded(events[cut:]))
    assert whole.tokens_per_round == pytest.approx(TOKENS_PER_ROUND)
    assert whole.acceptance_by_position() == pytest.approx(ACCEPTANCE)
    again = GenerationStats.from_counts(5, ACCEPTED, DRAFTED)
    assert (again.draft_tokens, again.accepted_tokens) == (12, 8)
    assert again.tokens_per_round == pytest.approx(TOKENS_PER_ROUND)


def test_no_rounds_no_figures():
    stats = folded([Token(1, Provenance.PLAIN), Done("length", 4, 1, 0.1, 0.0)])
    assert stats.tokens_per_round is None and stats.acceptance_by_position() == []
    assert stats.summary_line().startswith("Plain: 1 tokens, no drafting")


def test_the_playground_reads_the_same_figures():
    t = Trace(submitted_at=0.0)
    for i, e in enumerate(stream()):
        t.add(Traced(e, 0.1 * (i + 1)))
    t.add(Finished("stop", 4, 13, 0))
    assert t.tokens_per_round == pytest.approx(TOKENS_PER_ROUND)
    assert t.acceptance_by_position() == pytest.approx(ACCEPTANCE)
    assert (t.accepted, t.drafted, len(t.token_ids)) == (8, 12, 13)
    assert [(r.drafted, r.accepted) for r in t.rounds] == [(3, 2), (3, 3), (2, 0), (1, 1), (3, 2)]
    assert "<b>2.60</b> tokens/round" in render.stats_line(t)
    assert list(charts.positions_figure(t).data[0].y) == pytest.approx(ACCEPTANCE)


def test_stats_and_metrics_report_the_same_figures():
    m = ServerMetrics(draft_depth=3)
    m.record(Outcome(folded(stream()), "stop", 4, 0, 1.3, 0.1))
    spec = m.stats_json()["speculative"]
    assert spec["tokens_per_round"] == pytest.approx(TOKENS_PER_ROUND)
    assert spec["acceptance_by_position"] == pytest.approx(ACCEPTANCE)
    assert spec["drafted_per_position"] == DRAFTED
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(m.exposition().decode()) for s in f.samples}
    assert samples[("mlx:spec_decode_tokens_per_round", None)] == pytest.approx(TOKENS_PER_ROUND)
    assert [samples[("mlx:draft_acceptance_by_position", str(p))] for p in (1, 2, 3)] == pytest.approx(ACCEPTANCE)
    assert [samples[("mlx:draft_tokens_drafted_per_position_total", str(p))] for p in (1, 2, 3)] == DRAFTED


def test_the_bench_reports_the_same_figures(monkeypatch):
    stats = folded(stream())
    monkeypatch.setattr(bench, "run_mlx_lm", lambda lm, prompt, params: Run(stats.tokens, 10.0, 0.1))
    monkeypatch.setattr(bench, "run_dyno", lambda lm, prompt, params, spec, drafter=None: Run(stats.tokens, 20.0, 0.1, folded(stream())))
    res = paired_benchmark(None, [1], SamplingParams(), depths=[3], pairs=2, with_off=False)
    s = res["settings"]["mtp@3"]
    assert s["tokens_per_round"] == pytest.approx(TOKENS_PER_ROUND)
    assert s["acceptance_by_position"] == pytest.approx(ACCEPTANCE)
    assert (s["rounds"], s["accepted_per_position"], s["drafted_per_position"]) == (10, [8, 6, 2], [10, 8, 6])
    # Pooled over prompts by their counts: this prompt and one of 5 rounds that accepted every draft.
    full = {**s, "rounds": 5, "accepted_per_position": [5, 5, 5], "drafted_per_position": [5, 5, 5]}
    record = {"results": [{"suite": "code", "temperature": 0.0, "settings": {"mtp@3": x}} for x in (s, full)]}
    (row,) = _aggregate(record)
    assert row["tpr"] == pytest.approx(1 + (16 + 15) / 15)
    assert row["acceptance"] == pytest.approx([13 / 15, 11 / 13, 7 / 11])


def test_the_drafting_figures_of_one_answer():
    """runtime/figures.py from the same stream: rounds by depth, drafted = accepted + rejected (the cut
    round's undelivered draft among the rejected), and the hash of the ids as 4-byte little-endian words."""
    import hashlib

    from dyno_ui.runtime.figures import drafting_figures
    from speculative.stats import tokens_sha256

    stats = folded(stream())
    figures = drafting_figures(stats, True, prompt_tokens=4, cached_tokens=1)
    assert figures["rounds_by_depth"] == {"1": 1, "2": 1, "3": 3}
    assert (figures["draft_tokens"], figures["accepted_tokens"], figures["rejected_tokens"]) == (12, 8, 4)
    assert figures["by_source"] == {"mtp": {"draft_tokens": 12, "accepted_tokens": 8}}
    assert figures["accepted_per_position"] == ACCEPTED and figures["drafted_per_position"] == DRAFTED
    assert figures["tokens_per_round"] == TOKENS_PER_ROUND
    assert (figures["prompt_tokens"], figures["cached_prompt_tokens"], figures["prefill_s"]) == (4, 1, 0.1)
    assert figures["generated_tokens"] == 13 and figures["decode_tokens_per_s"] == pytest.approx(12 / 1.2)
    assert figures["tokens_sha256"] == hashlib.sha256(bytes([1, 0, 0, 0] + [2, 0, 0, 0] * 12)).hexdigest()
    assert tokens_sha256([]) == hashlib.sha256(b"").hexdigest()
    merged = GenerationStats()
    merged.merge(stats)
    merged.merge(stats)
    assert merged.rounds_by_depth == {1: 2, 2: 2, 3: 6}
    off = drafting_figures(GenerationStats(tokens=[5, 6]), False, 2, 0)
    assert off["mode"] == "off" and off["by_source"] == {} and off["rounds_by_depth"] == {}
    assert off["prefill_s"] is None and off["decode_tokens_per_s"] is None
