"""Generations as Plotly figures (pure functions of a Trace): rounds, acceptance, depth, histogram, race.

Every figure has a fixed height and margins so that panels do not move while they update.
"""

from typing import List, Optional, Sequence, Tuple

import plotly.graph_objects as go

from .trace import Trace

HEIGHT = 260
WINDOW = 100  # rounds shown in the per-round chart: the latest, so it stays cheap to redraw
COLORS = {"drafted": "#c8ccd4", "accepted": "#2e9e6b", "rate": "#d9822b", "mtp": "#2e9e6b", "plain": "#6b7280",
          "copy": "#7c3aed", "depth": "#374151"}
# Draft sources as the charts name them (Round.source: the MTP head's drafts, or copies from the context).
SOURCES = {"head": ("head", COLORS["accepted"]), "copy": ("copies", COLORS["copy"])}


def _figure(title: str, **layout) -> go.Figure:
    fig = go.Figure()
    base = dict(title=dict(text=title, font=dict(size=13)), height=HEIGHT, template="plotly_white",
                margin=dict(l=48, r=48, t=36, b=36), showlegend=True, legend=dict(orientation="h", y=-0.25, x=0))
    fig.update_layout(**{**base, **layout})
    return fig


def _empty(fig: go.Figure, message: str) -> go.Figure:
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(color="#888"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def rounds_figure(trace: Optional[Trace]) -> go.Figure:
    """Drafted vs accepted per round (bars, the last WINDOW rounds) and the tokens/s each round committed at (line, right axis)."""
    fig = _figure("Drafted vs accepted per round", barmode="overlay",
                  yaxis2=dict(title="tok/s", overlaying="y", side="right", showgrid=False, rangemode="tozero"))
    rounds = trace.rounds[-WINDOW:] if trace else []
    if not rounds:
        return _empty(fig, "no drafting rounds yet")
    first = len(trace.rounds) - len(rounds) + 1
    x = list(range(first, first + len(rounds)))
    fig.add_bar(x=x, y=[r.drafted for r in rounds], name="drafted", marker_color=COLORS["drafted"])
    for source, (word, color) in SOURCES.items():  # one round, one source: its bar in one of these
        if source == "head" or any(r.source == source for r in rounds):
            fig.add_bar(x=x, y=[r.accepted if r.source == source else None for r in rounds],
                        name=f"accepted: {word}", marker_color=color)
    fig.add_scatter(x=x, y=[r.tokens_per_s for r in rounds], name="tok/s", yaxis="y2", mode="lines",
                    line=dict(color=COLORS["rate"], width=1.5))
    fig.update_xaxes(title_text="round")
    # Only the left axis: dtick=1 on the tok/s axis would mean thousands of ticks, seconds per redraw.
    fig.layout.yaxis.update(title_text="tokens", dtick=1)
    return fig


def positions_figure(trace: Optional[Trace]) -> go.Figure:
    """Share of rounds whose draft at each position was accepted, for each draft source apart."""
    fig = _figure("Acceptance by draft position", barmode="group")
    sources = trace.by_source() if trace else {}
    if not sources:
        return _empty(fig, "no drafts yet")
    for source, counts in sources.items():
        word, color = SOURCES.get(source, (source, COLORS["accepted"]))
        rates = counts.acceptance_by_position()
        fig.add_bar(x=[f"d{i}" for i in range(1, len(rates) + 1)], y=rates, marker_color=color, name=word,
                    text=[f"{r:.0%}" for r in rates], textposition="auto")
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
    return fig


def depth_figure(trace: Optional[Trace]) -> go.Figure:
    """Each round's draft depth against where in the answer it drafted (every round, not a window):
    the depth policy's choices over a long answer, and copies' longer runs marked apart."""
    fig = _figure("Draft depth over the answer")
    rounds = trace.rounds if trace else []
    if not rounds:
        return _empty(fig, "no drafting rounds yet")
    fig.add_scatter(x=[r.first for r in rounds], y=[r.drafted for r in rounds], name="depth", mode="lines",
                    line=dict(shape="hv", width=1.5, color=COLORS["depth"]))
    copied = [r for r in rounds if r.source == "copy"]
    if copied:
        fig.add_scatter(x=[r.first for r in copied], y=[r.drafted for r in copied], name="copied round",
                        mode="markers", marker=dict(color=COLORS["copy"], size=6))
    fig.update_xaxes(title_text="answer token", rangemode="tozero")
    fig.update_yaxes(title_text="drafts", rangemode="tozero")
    return fig


def histogram_figure(trace: Optional[Trace]) -> go.Figure:
    """How many rounds committed 1, 2, ... depth+1 tokens."""
    fig = _figure("Tokens per round", showlegend=False)
    rounds = trace.rounds if trace else []
    if not rounds:
        return _empty(fig, "no drafting rounds yet")
    top = max(r.drafted for r in rounds) + 1
    counts = [sum(1 for r in rounds if r.tokens == n) for n in range(1, top + 1)]
    fig.add_bar(x=list(range(1, top + 1)), y=counts, marker_color=COLORS["accepted"])
    fig.update_xaxes(title_text="tokens committed", dtick=1)
    fig.update_yaxes(title_text="rounds")
    return fig


def answer_figures(trace: Optional[Trace]) -> List[go.Figure]:
    """The charts under an answer, in the page's order (the playground's panels and the exported file)."""
    return [rounds_figure(trace), positions_figure(trace), depth_figure(trace), histogram_figure(trace)]


def _progress(times: Sequence[float]) -> List[float]:
    return [t - times[0] for t in times] if times else []


def race_figure(spec: Optional[Trace], plain: Optional[Trace], until: Optional[float] = None,
                names: Tuple[str, str] = ("MTP", "plain")) -> go.Figure:
    """Tokens generated against time since each run's first token, both runs on one timeline
    (`names`: the two sides', the first in the drafting colour)."""
    fig = _figure("The race: tokens over time")
    if not (spec and spec.token_times) and not (plain and plain.token_times):
        return _empty(fig, "run a comparison")
    for (name, trace), color in zip(zip(names, (spec, plain)), (COLORS["mtp"], COLORS["plain"])):
        if trace is None:
            continue
        t = _progress(trace.token_times)
        n = list(range(1, len(t) + 1))
        if until is not None:
            t, n = [x for x in t if x <= until], n[: sum(1 for x in t if x <= until)]
        fig.add_scatter(x=t, y=n, name=name, mode="lines", line=dict(shape="hv", width=2, color=color))
    fig.update_xaxes(title_text="seconds since first token", rangemode="tozero")
    fig.update_yaxes(title_text="tokens", rangemode="tozero")
    return fig
