"""Generations as HTML: tokens coloured by provenance, the legend, the stats line (pure functions)."""

import html
import math
import statistics
from typing import Iterable, List, Optional, Sequence, Set, Tuple

from .trace import RoundPoint, Span, Trace

# CSS classes (assets/dyno.css) and the words the legend uses for them. Each kind differs in more
# than hue (underline style, strike-through), so the legend reads without colour vision too.
KINDS = {
    "draft": "accepted draft (solid underline)",
    "copy": "accepted copy: drafted from the context (dotted underline)",
    "correction": "correction: the model refused a draft (wavy underline)",
    "bonus": "bonus: all drafts accepted (double underline)",
    "plain": "model, no draft (plain)",
    "rejected": "rejected draft (struck through, faded)",
}
WORDS = {"draft": "accepted draft", "copy": "accepted copy from the context", "correction": "correction",
         "bonus": "bonus", "plain": "model token"}

# The hover/tap card: one floating element filled from the token's data-card, for the page and for
# exported files alike (event delegation: it survives every re-render of the answer).
CARD_JS = """(() => {
  if (window.dynoCard) return; window.dynoCard = true;
  const card = () => { let c = document.getElementById('dyno-card');
    if (!c) { c = document.createElement('div'); c.id = 'dyno-card'; c.setAttribute('role', 'tooltip');
              c.hidden = true; document.body.appendChild(c); } return c; };
  const show = (el) => { const c = card(), r = el.getBoundingClientRect(); c.textContent = el.dataset.card;
    c.style.left = Math.max(4, Math.min(r.left, innerWidth - 340)) + 'px'; c.style.top = (r.bottom + 6) + 'px';
    c.hidden = false; };
  const target = (e) => e.target instanceof Element ? e.target.closest('[data-card]') : null;
  document.addEventListener('mouseover', (e) => { const t = target(e); if (t) show(t); else card().hidden = true; });
  document.addEventListener('click', (e) => { const t = target(e); if (t) show(t); });
})();"""


def _prob(x: float) -> str:
    return f"{x:.4f}"


def _draft_numbers(r: RoundPoint, i: int, greedy_word: str = "the model's argmax") -> str:
    """p, q and the acceptance chance of draft i of round r (empty without details)."""
    d = r.details
    if d is None or i >= len(d.p):
        return ""
    if d.q[i] is None:  # greedy: kept exactly when it was the argmax
        return f" · p {_prob(d.p[i])} · {'was' if d.accept[i] else 'was not'} {greedy_word}"
    return f" · p {_prob(d.p[i])} · q {_prob(d.q[i])} · min(1, p/q) {_prob(d.accept[i])}"


def token_card(trace: Trace, index: int) -> str:
    """What the hover card says about token `index`: round, position, provenance and, with details, p and q."""
    t = trace.tokens[index]
    if t.round == 0:
        where = "first token (prefill)" if index == 0 and trace.rounds else "plain decoding"
        return f"{where} · {WORDS[t.kind]}" + (f" · p {_prob(math.exp(t.logprob))}" if t.logprob is not None else "")
    r = trace.rounds[t.round - 1]
    text = f"round {t.round} · position {t.position + 1} of {r.drafted + 1} · {WORDS[t.kind]}"
    if t.kind in ("draft", "copy"):
        return text + _draft_numbers(r, t.position)
    if r.details is not None:
        text += f" · p {_prob(r.details.next_p)}"
    if t.kind == "correction" and t.position < len(r.drafts):
        text += f" · replaced draft {trace.piece(r.drafts[t.position])!r}" + _draft_numbers(r, t.position)
    return text


def rejected_card(trace: Trace, r: RoundPoint, number: int, i: int) -> str:
    first = i == r.accepted
    why = "refused by the verify pass" if first else "never checked: after a refused draft"
    return f"round {number} · position {i + 1} · rejected draft, {why}" + (_draft_numbers(r, i) if first else "")


def _attr(text: str) -> str:
    return html.escape(text, quote=True)


def token_spans(spans: Iterable[Span], trace: Optional[Trace] = None, rejected: bool = False,
                upto: Optional[int] = None) -> str:
    """Each span as <span class="tok tok-KIND">, escaped; whitespace kept by the CSS (pre-wrap). With a
    trace, each carries its hover card; with `rejected`, the refused drafts of a round come struck
    through just before the correction that replaced them. `upto`: only tokens before that index."""
    out: List[str] = []
    shown: Set[int] = set()
    for s in spans:
        if upto is not None and s.token >= upto:
            break
        if trace is None or not (0 <= s.token < len(trace.tokens)):
            out.append(f'<span class="tok tok-{s.kind}">{html.escape(s.text)}</span>')
            continue
        if rejected:  # every correction up to this span's token whose refused drafts are not yet shown
            for n, r in enumerate(trace.rounds, 1):
                if r.first > s.token:
                    break
                if n not in shown and r.rejected and r.first + r.accepted <= s.token:
                    shown.add(n)
                    out.extend(f'<span class="tok tok-rejected" data-id="{d}" data-card="{_attr(rejected_card(trace, r, n, i))}">'
                               f'{html.escape(trace.piece(d))}</span>'
                               for i, d in enumerate(r.drafts[r.accepted:], r.accepted))
        out.append(f'<span class="tok tok-{s.kind}" data-i="{s.token}" data-card="{_attr(token_card(trace, s.token))}">'
                   f'{html.escape(s.text)}</span>')
    return "".join(out)


def answer_html(trace: Optional[Trace], until: Optional[float] = None, placeholder: str = "",
                rejected: bool = False, upto: Optional[int] = None, tail: str = "") -> str:
    """The answer panel: reasoning (collapsible) then content, each token coloured; spans after `until`
    (seconds) or from token `upto` on left out; `tail` (HTML) follows the content."""
    if trace is None or not trace.spans:
        return f'<div class="dyno-answer empty">{html.escape(placeholder)}</div>'
    shown = [s for s in trace.spans if until is None or s.at <= until]
    reasoning = [s for s in shown if s.channel == "reasoning"]
    content = [s for s in shown if s.channel == "content"]
    parts: List[str] = ['<div class="dyno-answer">']
    if reasoning:
        parts.append(f'<details class="dyno-thinking"><summary>Thinking</summary>'
                     f'<div class="dyno-tokens">{token_spans(reasoning, trace, rejected, upto)}</div></details>')
    parts.append(f'<div class="dyno-tokens">{token_spans(content, trace, rejected, upto)}{tail}</div></div>')
    return "".join(parts)


def legend_html() -> str:
    """Which colour and line style is which provenance."""
    items = "".join(f'<span class="legend-item"><span class="tok tok-{k}">&nbsp;{k}&nbsp;</span> {html.escape(v)}</span>'
                    for k, v in KINDS.items())
    return f'<div class="dyno-legend" aria-label="Token colours">{items}</div>'


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
        _copied(trace),
        f"TTFT <b>{_num(None if ttft is None else ttft * 1000, '.0f')}</b> ms",
    ]
    if trace.error:
        items.append(f'<span class="error">{html.escape(trace.error)}</span>')
    elif trace.finish_reason:
        items.append(f"finished: {html.escape(trace.finish_reason)}")
    return '<div class="dyno-stats">' + " · ".join(i for i in items if i) + "</div>"


def _copied(trace: Trace) -> str:
    """Of the drafts, those copied from the context, when there were any."""
    copies = trace.by_source().get("copy")
    return f'<b class="copied">{copies.accepted_tokens}/{copies.draft_tokens}</b> copies accepted' if copies else ""


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


def race_summary(pairs: Sequence[Tuple[Trace, Trace]], greedy: bool, decode=lambda ids: str(ids),
                 depth: Optional[int] = None, auto_depth: Optional[int] = None,
                 names: Tuple[str, str] = ("MTP", "plain")) -> str:
    """A race repeated len(pairs) times: median tok/s each way (`names`: its sides'), the median speedup
    with its spread (min–max over the runs), the depth raced and whether auto chose it, and at
    temperature 0 whether every run's outputs are identical."""
    speedups = race_speedups(pairs)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    a = med([s.tokens_per_s for s, _ in pairs if s.tokens_per_s])
    b = med([p.tokens_per_s for _, p in pairs if p.tokens_per_s])
    m = med(speedups)
    if m is None:
        speedup = "speedup –"
    elif len(speedups) > 1:
        speedup = (f"<b>{m:.2f}×</b> speedup (median of {len(speedups)} runs, spread "
                   f"{min(speedups):.2f}–{max(speedups):.2f}×)")
    else:
        speedup = f"<b>{m:.2f}×</b> speedup (1 run)"
    rows = [f'<span class="race-mtp">{html.escape(names[0])} <b>{_num(a, ".1f")}</b> tok/s</span>',
            f'<span class="race-plain">{html.escape(names[1])} <b>{_num(b, ".1f")}</b> tok/s</span>', speedup]
    if depth is not None:
        rows.append(f"depth {depth} (auto's choice)" if depth == auto_depth or auto_depth is None
                    else f"depth {depth} (auto would choose {auto_depth})")
    spec = pairs[len(pairs) // 2][0] if pairs else None
    if spec is not None and spec.rounds:
        rows.append(f"{spec.accepted}/{spec.drafted} drafts accepted")
    if greedy:
        diffs = [(n, i) for n, (s, p) in enumerate(pairs, 1) if (i := first_difference(s.token_ids, p.token_ids)) is not None]
        if not diffs:
            rows.append('<span class="identical">✓ identical output</span>' + (" in every run" if len(pairs) > 1 else ""))
        else:
            n, i = diffs[0]
            s, p = pairs[n - 1]
            got = decode(s.token_ids[i:i + 1]) if i < len(s.token_ids) else "(end)"
            want = decode(p.token_ids[i:i + 1]) if i < len(p.token_ids) else "(end)"
            rows.append(f'<span class="different">✗ outputs differ in run {n} at token {i}: '
                        f'{html.escape(repr(got))} vs {html.escape(repr(want))}</span>')
    return '<div class="dyno-stats compare">' + " · ".join(rows) + "</div>"


def race_speedups(pairs: Sequence[Tuple[Trace, Trace]]) -> List[float]:
    """The first side's tok/s over the second's (MTP over plain) for each run that has both."""
    return [s.tokens_per_s / p.tokens_per_s for s, p in pairs if s.tokens_per_s and p.tokens_per_s]


def cost_note(model: str, costs: dict, depth: int, tokens_per_round: float, measured: float) -> str:
    """Why drafting does not pay here, in one line, from the cost model (speculative/measure/cost_model.py):
    a round delivers `tokens_per_round` tokens and costs Tv(k)/T1 + k*Td/T1 plain steps."""
    t1, tv, td = costs["T1"], costs["Tv"][depth], costs["Td"]
    verify, drafts = tv / t1, depth * td / t1
    bound = tokens_per_round / (verify + drafts)
    limit = (f"the verify pass ({verify:.2f} plain steps) limits it" if verify >= drafts
             else f"the {depth} head steps ({drafts:.2f} plain steps) limit it")
    if bound >= 1:
        return (f"Drafting measured {measured:.2f}× although the cost model allows {bound:.2f}× for {model} on this "
                f"machine: the time outside the model calls (Python, host syncs) takes the gain.")
    return (f"Drafting does not pay for {model} on this machine: the cost model bounds the speedup at {bound:.2f}× "
            f"({tokens_per_round:.2f} tokens per round for a round costing {verify + drafts:.2f} plain steps); {limit}.")
