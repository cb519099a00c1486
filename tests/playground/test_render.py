"""The playground's pure layers: traced job outputs -> Trace -> coloured HTML and Plotly figures."""

from speculative.events import Done, Provenance, Round, Token

from dyno_ui.playground import charts, render
from dyno_ui.playground.trace import Trace
from dyno_ui.runtime.outputs import Finished, TextDelta, Traced


def traced(rounds=((3, 2), (3, 3))) -> Trace:
    """A trace as the worker sends it: a plain first token, then rounds of drafts + correction/bonus."""
    t = Trace(submitted_at=0.0)
    at = 0.1
    t.add(Traced(Token(1, Provenance.PLAIN), at))
    t.add(TextDelta("content", "<a>"))
    for drafted, accepted in rounds:
        at += 0.1
        t.add(Traced(Round(drafted, accepted), at))
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
    assert '<span class="tok tok-plain">&lt;a&gt;</span>' in html
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
