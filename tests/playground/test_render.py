"""The playground's pure layers: traced job outputs -> Trace -> coloured HTML and Plotly figures."""

import json
import re

from speculative.events import Done, Provenance, Round, RoundDetails, Token

from dyno_ui.playground import charts, export, render, replay
from dyno_ui.playground.trace import Trace
from dyno_ui.runtime.outputs import Finished, TextDelta, Traced


def traced(rounds=((3, 2), (3, 3))) -> Trace:
    """A trace as the worker sends it: a plain first token, then rounds of drafts + correction/bonus."""
    t = Trace(submitted_at=0.0, decode=lambda ids: "".join(f"x{i}" for i in ids))
    at = 0.1
    t.add(Traced(Token(1, Provenance.PLAIN), at))
    t.add(TextDelta("content", "<a>"))
    for drafted, accepted in rounds:
        at += 0.1
        drafts = tuple(range(10, 10 + drafted))
        details = RoundDetails(tuple(0.5 for _ in drafts), (None,) * drafted,
                               tuple(1.0 if i < accepted else 0.0 for i in range(drafted)), 0.9)
        t.add(Traced(Round(drafted, accepted, drafts, details), at))
        for _ in range(accepted):
            t.add(Traced(Token(2, Provenance.DRAFT), at))
            t.add(TextDelta("content", "d"))
        kind = Provenance.BONUS if accepted == drafted else Provenance.CORRECTION
        t.add(Traced(Token(3, kind), at))
        t.add(TextDelta("content", kind.value[0]))
    t.add(Traced(Done("length", 5, len(t.token_ids), 0.1, at - 0.1), at))
    t.add(Finished("length", 5, len(t.token_ids), 0))
    return t


def test_trace_folds_tokens_rounds_and_timing():
    t = traced()
    assert t.finished and t.finish_reason == "length"
    assert t.text() == "<a>ddcdddb"
    assert (t.accepted, t.drafted, len(t.rounds)) == (5, 6, 2)
    assert t.accepted_per_position == [2, 2, 1]
    assert t.acceptance_by_position() == [1.0, 1.0, 0.5]
    assert t.tokens_per_round == (len(t.token_ids) - 1) / 2
    assert abs(t.ttft_s - 0.1) < 1e-9
    assert [r.tokens for r in t.rounds] == [3, 4]


def test_spans_are_coloured_by_provenance_and_escaped():
    html = render.answer_html(traced())
    assert re.search(r'<span class="tok tok-plain" data-i="0" data-card="[^"]*">&lt;a&gt;</span>', html)
    assert html.count("tok-draft") == 5 and html.count("tok-correction") == 1 and html.count("tok-bonus") == 1
    assert "<a>" not in html
    partial = render.answer_html(traced(), until=0.2)  # the replay: only what had arrived by then
    assert partial.count("tok-draft") == 2 and "tok-bonus" not in partial
    for kind in render.KINDS:
        assert f"tok-{kind}" in render.legend_html()


def test_reasoning_is_collapsible():
    t = Trace(0.0)
    t.add(Traced(Token(1, Provenance.PLAIN), 0.1))
    t.add(TextDelta("reasoning", "hmm"))
    t.add(TextDelta("content", "yes"))
    html = render.answer_html(t)
    assert "<details" in html and html.index("hmm") < html.index("</details>") < html.index("yes")


def test_stats_line_and_compare_summary():
    line = render.stats_line(traced())
    assert "5/6</b> drafts accepted" in line and "finished: length" in line and "TTFT <b>100</b> ms" in line
    spec, plain = traced(), traced()
    assert "identical output" in render.compare_summary(spec, plain, greedy=True)
    plain.token_ids[3] = 99
    assert "differ at token 3" in render.compare_summary(spec, plain, greedy=True, decode=str)
    assert render.first_difference([1, 2], [1, 2, 3]) == 2


def test_figures_have_the_data_and_a_fixed_height():
    t = traced()
    rounds = charts.rounds_figure(t)
    assert [list(tr.y) for tr in rounds.data[:2]] == [[3, 3], [2, 3]] and rounds.layout.height == charts.HEIGHT
    # Unit ticks on the token axis only: on the tok/s axis they meant thousands of ticks per redraw,
    # which froze the browser while a long answer streamed.
    assert rounds.layout.yaxis.dtick == 1 and rounds.layout.yaxis2.dtick is None
    assert list(charts.positions_figure(t).data[0].y) == [1.0, 1.0, 0.5]
    assert list(charts.histogram_figure(t).data[0].y) == [0, 0, 1, 1]
    race = charts.race_figure(t, traced(rounds=()))
    assert [tr.name for tr in race.data] == ["MTP", "plain"]
    for empty in (charts.rounds_figure(None), charts.positions_figure(None), charts.race_figure(None, None)):
        assert not empty.data and empty.layout.annotations


def test_rejected_drafts_come_struck_before_their_correction_only_when_asked():
    t = traced()
    assert t.rejected == [12] and [r.closer for r in t.rounds] == ["correction", "bonus"]
    assert "tok-rejected" not in render.answer_html(t)
    html = render.answer_html(t, rejected=True)
    assert html.count("tok-rejected") == 1 and 'data-id="12"' in html
    # beside the token that replaced it: after the round's two kept drafts, right before the correction
    assert re.search(r'tok-draft[^>]*>d</span><span class="tok tok-rejected" data-id="12"[^>]*>x12</span>'
                     r'<span class="tok tok-correction"', html)


def test_hover_cards_name_round_position_provenance_and_details():
    t = traced()
    assert render.token_card(t, 0).startswith("first token (prefill)")
    card = render.token_card(t, 1)
    assert card.startswith("round 1 · position 1 of 4 · accepted draft") and "p 0.5000 · was the model" in card
    card = render.token_card(t, 3)
    assert "round 1 · position 3 of 4 · correction" in card and "p 0.9000" in card and "replaced draft 'x12'" in card
    assert "bonus" in render.token_card(t, 7)


def test_replay_has_four_frames_per_round_and_clamps():
    t = traced()
    assert replay.frames(t) == 8 and replay.frames(None) == 0
    first, verdict = replay.replay_html(t, 0), replay.replay_html(t, 1)
    assert "Round 1 of 2 · draft" in first and first.count('data-state="proposed"') == 3
    assert verdict.count('data-state="kept"') == 2 and verdict.count('data-state="refused"') == 1
    assert 'data-state="refused"' not in replay.replay_html(t, 2)  # rolled back
    assert "correction" in replay.replay_html(t, 3) and "Round 2 of 2 · commit" in replay.replay_html(t, 99)


def test_exports_are_standalone_and_carry_the_trace():
    t = traced()
    meta = {"model": "tiny", "prompt": "p", "settings": {"temperature": 0}}
    page = export.answer_html_file(t, meta)
    assert page.startswith("<!doctype html>") and "tok-rejected" in page and "Plotly" in page
    assert "src=\"http" not in page and "<link" not in page  # nothing fetched: CSS and scripts inline
    data = json.loads(export.answer_json(t, meta))
    assert data["model"] == "tiny" and [x["id"] for x in data["trace"]["tokens"]] == t.token_ids
    assert data["trace"]["rounds"][0]["rejected"] == [12] and data["trace"]["rounds"][0]["details"]["next_p"] == 0.9


def test_race_summary_reports_the_median_and_spread_and_the_cost_note_says_why():
    pairs = []
    for gap in (0.05, 0.1, 0.2):  # plain runs of three speeds against the same MTP run
        spec, plain = traced(), traced(rounds=((3, 0),) * 7)
        plain.token_times[:] = [i * (0.1 + gap) for i in range(len(plain.token_times))]
        pairs.append((spec, plain))
    speedups = render.race_speedups(pairs)
    line = render.race_summary(pairs, greedy=False, depth=3, auto_depth=3)
    m = sorted(speedups)[1]
    assert f"<b>{m:.2f}×</b> speedup (median of 3 runs, spread {min(speedups):.2f}–{max(speedups):.2f}×)" in line
    assert "depth 3 (auto's choice)" in line
    assert "auto would choose 2" in render.race_summary(pairs[:1], greedy=False, depth=3, auto_depth=2)
    costs = {"T1": 1.0, "Tv": {3: 1.5}, "Td": 0.4}
    note = render.cost_note("tiny", costs, 3, 2.0, 0.7)  # a round: 1.5 + 1.2 steps for 2 tokens
    assert "bounds the speedup at 0.74×" in note and "the verify pass (1.50 plain steps) limits it" in note
    assert "time outside the model calls" in render.cost_note("tiny", costs, 3, 3.0, 0.9)


def test_race_exports_carry_both_runs_and_every_speedup():
    spec, plain = traced(), traced()
    meta = {"model": "tiny", "prompt": "p", "settings": {"runs": 1}}
    page = export.race_html_file(spec, plain, render.race_summary([(spec, plain)], greedy=True), meta)
    assert "identical output" in page and page.count('class="dyno-answer"') == 2 and "Plotly" in page
    data = json.loads(export.race_json({"mtp": [spec], "plain": [plain]}, meta, [1.5]))
    assert data["kind"] == "race" and data["speedups"] == [1.5]
    assert [t["provenance"] for t in data["runs"]["mtp"][0]["tokens"]][:2] == ["plain", "draft"]


def test_copied_rounds_are_counted_charted_and_raced_apart():
    """A head round (3 drafts, 2 kept) then a copied one (8 drafts, 6 kept): the stats line, the rounds,
    acceptance and depth charts split them by source; a race's sides name themselves; an unknown race
    is a one-line error."""
    import pytest

    from dyno_ui.playground import races
    from speculative.errors import DynoError

    t = Trace(submitted_at=0.0)
    t.add(Traced(Token(1, Provenance.PLAIN), 0.1))
    for at, (drafted, accepted, source) in enumerate(((3, 2, "head"), (8, 6, "copy")), 2):
        t.add(Traced(Round(drafted, accepted, tuple(range(drafted)), source=source), at / 10))
        kind = Provenance.DRAFT if source == "head" else Provenance.COPY
        for _ in range(accepted):
            t.add(Traced(Token(2, kind), at / 10))
        t.add(Traced(Token(3, Provenance.CORRECTION), at / 10))
    assert [r.source for r in t.rounds] == ["head", "copy"] and set(t.by_source()) == {"head", "copy"}
    assert "6/8</b> copies accepted" in render.stats_line(t) and "8/11</b> drafts accepted" in render.stats_line(t)
    assert "copies accepted" not in render.stats_line(traced())
    rounds = {tr.name: list(tr.y) for tr in charts.rounds_figure(t).data}
    assert rounds["accepted: head"] == [2, None] and rounds["accepted: copies"] == [None, 6]
    assert "accepted: copies" not in {tr.name for tr in charts.rounds_figure(traced()).data}
    positions = {tr.name: list(tr.y) for tr in charts.positions_figure(t).data}
    assert positions["head"] == [1.0, 1.0, 0.0] and positions["copies"] == [1.0] * 6 + [0.0, 0.0]
    depth = {tr.name: (list(tr.x), list(tr.y)) for tr in charts.depth_figure(t).data}
    assert depth == {"depth": ([1, 4], [3, 8]), "copied round": ([4], [8])}  # x: the answer's tokens before it
    assert len(charts.answer_figures(t)) == 4 and not charts.depth_figure(None).data
    sides = races.pairing("head + copies against the head alone")
    assert [(s.mode, s.copies) for s in sides] == [("mtp", "on"), ("mtp", "off")]
    summary = render.race_summary([(t, t)], greedy=True, names=races.names(sides))
    assert "head + copies <b>" in summary and "head only <b>" in summary and "identical output" in summary
    assert [tr.name for tr in charts.race_figure(t, t, names=races.names(sides)).data] == ["head + copies", "head only"]
    with pytest.raises(DynoError, match=r"^race must be one of .*, got 'fastest'$"):
        races.pairing("fastest")
    from dyno_ui.playground.sessions import Sessions

    assert Sessions(None).copies("only") == "only"  # the page's toggle, checked as the API checks "copies"
    with pytest.raises(DynoError, match=r"^copies must be one of on, off, only, got 3$"):
        Sessions(None).copies(3)
