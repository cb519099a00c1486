"""Generations as Plotly figures (pure functions of a Trace): rounds, acceptance, histogram, race.

Every figure has a fixed height and margins so that panels do not move while they update.
"""

from typing import List, Optional, Sequence

import plotly.graph_objects as go

from .trace import Trace

HEIGHT = 260
WINDOW = 100  # rounds shown in the per-round chart: the latest, so it stays cheap to redraw
COLORS = {"drafted": "#c8ccd4", "accepted": "#2e9e6b", "rate": "#d9822b", "mtp": "#2e9e6b", "plain": "#6b7280"}


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
    fig.add_bar(x=x, y=[r.accepted for r in rounds], name="accepted", marker_color=COLORS["accepted"])
    fig.add_scatter(x=x, y=[r.tokens_per_s for r in rounds], name="tok/s", yaxis="y2", mode="lines",
                    line=dict(color=COLORS["rate"], width=1.5))
    fig.update_xaxes(title_text="round")
    # Only the left axis: dtick=1 on the tok/s axis would mean thousands of ticks, seconds per redraw.
    fig.layout.yaxis.update(title_text="tokens", dtick=1)
    return fig


def positions_figure(trace: Optional[Trace]) -> go.Figure:
    """Share of rounds whose draft at each position was accepted."""
    fig = _figure("Acceptance by draft position", showlegend=False)
    rates = trace.acceptance_by_position() if trace else []
    if not rates:
        return _empty(fig, "no drafts yet")
    fig.add_bar(x=[f"d{i}" for i in range(1, len(rates) + 1)], y=rates, marker_color=COLORS["accepted"],
                text=[f"{r:.0%}" for r in rates], textposition="auto")
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
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


def _progress(times: Sequence[float]) -> List[float]:
    return [t - times[0] for t in times] if times else []


def race_figure(spec: Optional[Trace], plain: Optional[Trace], until: Optional[float] = None) -> go.Figure:
    """Tokens generated against time since each run's first token, both runs on one timeline."""
    fig = _figure("The race: tokens over time")
    if not (spec and spec.token_times) and not (plain and plain.token_times):
        return _empty(fig, "run a comparison")
    for name, trace in (("MTP", spec), ("plain", plain)):
        if trace is None:
            continue
        t = _progress(trace.token_times)
        n = list(range(1, len(t) + 1))
        if until is not None:
            t, n = [x for x in t if x <= until], n[: sum(1 for x in t if x <= until)]
        fig.add_scatter(x=t, y=n, name=name, mode="lines", line=dict(shape="hv", width=2,
                                                                    color=COLORS["mtp" if name == "MTP" else "plain"]))
    fig.update_xaxes(title_text="seconds since first token", rangemode="tozero")
    fig.update_yaxes(title_text="tokens", rangemode="tozero")
    return fig
