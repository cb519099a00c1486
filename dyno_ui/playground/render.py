"""Generations as HTML: tokens coloured by provenance, the legend, the stats line (pure functions)."""

import html
from typing import Iterable, List, Optional

from .trace import Span, Trace

# CSS classes (assets/dyno.css) and the words the legend uses for them.
KINDS = {
    "draft": "accepted draft",
    "correction": "correction (draft rejected)",
    "bonus": "bonus (all drafts accepted)",
    "plain": "model (no draft)",
}


def token_spans(spans: Iterable[Span]) -> str:
    """Each span as <span class="tok tok-KIND">, escaped; whitespace kept by the CSS (pre-wrap)."""
    return "".join(f'<span class="tok tok-{s.kind}">{html.escape(s.text)}</span>' for s in spans)


def answer_html(trace: Optional[Trace], until: Optional[float] = None, placeholder: str = "") -> str:
    """The answer panel: reasoning (collapsible) then content, each token coloured; spans after `until` left out."""
    if trace is None or not trace.spans:
        return f'<div class="dyno-answer empty">{html.escape(placeholder)}</div>'
    shown = [s for s in trace.spans if until is None or s.at <= until]
    reasoning = [s for s in shown if s.channel == "reasoning"]
    content = [s for s in shown if s.channel == "content"]
    parts: List[str] = ['<div class="dyno-answer">']
    if reasoning:
        parts.append(f'<details class="dyno-thinking"><summary>Thinking</summary>'
                     f'<div class="dyno-tokens">{token_spans(reasoning)}</div></details>')
    parts.append(f'<div class="dyno-tokens">{token_spans(content)}</div></div>')
    return "".join(parts)


def legend_html() -> str:
    """Which colour is which provenance."""
    items = "".join(f'<span class="legend-item"><span class="tok tok-{k}">&nbsp;{k}&nbsp;</span> {html.escape(v)}</span>'
                    for k, v in KINDS.items())
    return f'<div class="dyno-legend">{items}</div>'


def _num(value: Optional[float], fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def stats_line(trace: Optional[Trace]) -> str:
    """tok/s, tokens per round, drafts accepted / drafted, time to first token, as one line."""
    if trace is None:
        return '<div class="dyno-stats">&nbsp;</div>'
    ttft = trace.ttft_s
    items = [
        f"<b>{_num(trace.tokens_per_s, '.1f')}</b> tok/s",
        f"<b>{len(trace.token_ids)}</b> tokens",
        f"<b>{_num(trace.tokens_per_round, '.2f')}</b> tokens/round" if trace.rounds else "no drafting",
        f'<b class="accepted">{trace.accepted}/{trace.drafted}</b> drafts accepted' if trace.rounds else "",
        f"TTFT <b>{_num(None if ttft is None else ttft * 1000, '.0f')}</b> ms",
    ]
    if trace.error:
        items.append(f'<span class="error">{html.escape(trace.error)}</span>')
    elif trace.finish_reason:
        items.append(f"finished: {html.escape(trace.finish_reason)}")
    return '<div class="dyno-stats">' + " · ".join(i for i in items if i) + "</div>"


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    """Index of the first differing token (or of the end of the shorter list); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_summary(spec: Trace, plain: Trace, greedy: bool, decode=lambda ids: str(ids)) -> str:
    """Tok/s of each run, the speedup, and at temperature 0 whether the outputs are identical."""
    a, b = spec.tokens_per_s, plain.tokens_per_s
    speedup = f"<b>{a / b:.2f}×</b> speedup" if a and b else "speedup –"
    rows = [f'<span class="race-mtp">MTP <b>{_num(a, ".1f")}</b> tok/s</span>',
            f'<span class="race-plain">plain <b>{_num(b, ".1f")}</b> tok/s</span>', speedup]
    if spec.rounds:
        rows.append(f"{spec.accepted}/{spec.drafted} drafts accepted")
    if greedy:
        i = first_difference(spec.token_ids, plain.token_ids)
        if i is None:
            rows.append('<span class="identical">✓ identical output</span>')
        else:
            got = decode(spec.token_ids[i:i + 1]) if i < len(spec.token_ids) else "(end)"
            want = decode(plain.token_ids[i:i + 1]) if i < len(plain.token_ids) else "(end)"
            rows.append(f'<span class="different">✗ outputs differ at token {i}: '
                        f'{html.escape(repr(got))} vs {html.escape(repr(want))}</span>')
    return '<div class="dyno-stats compare">' + " · ".join(rows) + "</div>"
