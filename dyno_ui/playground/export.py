"""A finished answer or race as one self-contained HTML file and as JSON (pure: no Gradio, no MLX).

The HTML inlines the playground's CSS, Plotly's JavaScript and the hover card's script, so it opens
from disk with no server and no network; the JSON is the trace itself.
"""

import html
import json
from dataclasses import asdict
from typing import List, Mapping, Optional, Tuple

import plotly.io as pio

from ..paths import ASSETS
from . import charts, render
from .trace import Trace

# Gradio's theme variables that dyno.css reads, for a page without Gradio.
PAGE_CSS = """
:root { --border-color-primary: #d1d5db; --background-fill-secondary: #f9fafb;
        --body-text-color-subdued: #6b7280; --radius-lg: 8px;
        --font-mono: ui-monospace, SFMono-Regular, Menlo, monospace; }
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5rem auto; max-width: 1100px;
       padding: 0 1rem; color: #111827; }
.dyno-answer { max-height: none; }
.dyno-meta { color: #4b5563; font-size: 0.9rem; }
.dyno-export-charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr)); gap: 0.5rem; }
body.hide-rejected .tok-rejected { display: none; }
.race-cols { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
"""
TOGGLE = ('<label><input type="checkbox" id="show-rejected" checked '
          'onchange="document.body.classList.toggle(\'hide-rejected\', !this.checked)"> show rejected drafts</label>')


def _figures(figs) -> str:
    """Plotly figures as divs; the library inlined once, with the first."""
    return "".join(pio.to_html(f, full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False})
                   for i, f in enumerate(figs))


def _settings_line(meta: Mapping) -> str:
    settings = ", ".join(f"{k} {v}" for k, v in meta.get("settings", {}).items())
    return (f'<p class="dyno-meta">Model <b>{html.escape(str(meta.get("model", "?")))}</b> · '
            f"{html.escape(settings)}</p>")


def _prompt_lines(meta: Mapping) -> str:
    """The prompt's text, and its images by name, digest and patch grid (the bytes stay out of the file)."""
    out = f"<p><b>Prompt:</b> {html.escape(meta['prompt'])}</p>" if meta.get("prompt") else ""
    images = "; ".join(f"{i['name']} (sha256 {i['sha256'][:12]}…, grid {'x'.join(map(str, i['grid']))})"
                       for i in meta.get("images") or ())
    return out + (f"<p><b>Images:</b> {html.escape(images)}</p>" if images else "")


def _page(title: str, body: str) -> str:
    css = (ASSETS / "dyno.css").read_text()
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{css}{PAGE_CSS}</style></head><body>{body}'
            f'<script>{render.CARD_JS}</script></body></html>')


def answer_html_file(trace: Trace, meta: Mapping) -> str:
    """The answer page: coloured tokens with rejected drafts, hover cards, stats, charts, model and settings."""
    body = (f"<h1>Dyno answer</h1>{_settings_line(meta)}"
            + _prompt_lines(meta)
            + render.legend_html() + TOGGLE + render.answer_html(trace, rejected=True) + render.stats_line(trace)
            + '<div class="dyno-export-charts">'
            + _figures(charts.answer_figures(trace))
            + "</div>")
    return _page("Dyno answer", body)


def race_html_file(spec: Trace, plain: Trace, summary: str, meta: Mapping,
                   names: Tuple[str, str] = ("MTP", "plain")) -> str:
    """The race page: the summary line, both answers side by side (`names`: the two sides'), the race chart."""
    first, second = (html.escape(n) for n in names)
    body = (f"<h1>Dyno race: {first} against {second}</h1>{_settings_line(meta)}"
            + _prompt_lines(meta)
            + summary + render.legend_html() + TOGGLE
            + f'<div class="race-cols"><div><div class="race-label race-mtp">{first}</div>'
            + render.answer_html(spec, rejected=True) + f'</div><div><div class="race-label race-plain">{second}</div>'
            + render.answer_html(plain, rejected=True) + "</div></div>"
            + _figures([charts.race_figure(spec, plain, names=names)]))
    return _page("Dyno race", body)


def trace_record(trace: Trace) -> dict:
    """One generation as plain data: text, every token (id, text pieces, provenance, round, position),
    every round (drafts, the refused ones, p/q details when recorded) and the stats."""
    pieces: List[List[str]] = [[] for _ in trace.tokens]
    for s in trace.spans:
        if 0 <= s.token < len(pieces):
            pieces[s.token].append(s.text)
    return {
        "text": trace.text(), "reasoning": trace.text("reasoning"),
        "tokens": [{"id": t.id, "text": "".join(p), "provenance": t.kind, "round": t.round, "position": t.position,
                    "logprob": t.logprob} for t, p in zip(trace.tokens, pieces)],
        "rounds": [{"drafted": r.drafted, "accepted": r.accepted, "drafts": list(r.drafts),
                    "rejected": list(r.rejected), "closer": r.closer, "seconds": r.seconds,
                    "details": asdict(r.details) if r.details is not None else None} for r in trace.rounds],
        "stats": {"tokens": len(trace.tokens), "tokens_per_s": trace.tokens_per_s,
                  "tokens_per_round": trace.tokens_per_round, "drafts_accepted": trace.accepted,
                  "drafts_drafted": trace.drafted, "ttft_s": trace.ttft_s, "finish_reason": trace.finish_reason,
                  "error": trace.error},
    }


def answer_json(trace: Trace, meta: Mapping) -> str:
    return json.dumps({"kind": "answer", **meta, "trace": trace_record(trace)}, indent=1)


def race_json(runs: Mapping[str, List[Trace]], meta: Mapping, speedups: Optional[List[float]] = None) -> str:
    """Every run of a race ({"mtp": [...], "plain": [...]}, or its pairing's keys) and each repeat's speedup."""
    return json.dumps({"kind": "race", **meta, "speedups": speedups or [],
                       "runs": {k: [trace_record(t) for t in v] for k, v in runs.items()}}, indent=1)
