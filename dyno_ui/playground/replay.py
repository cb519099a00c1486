"""Rounds in slow motion: a recorded Trace replayed round by round (pure: HTML from a trace and a frame).

Each round is four frames: the drafts appear, the verify pass's verdict, the rollback of what was
refused, and the model's own token (correction or bonus) committed. Nothing is generated again.
"""

import html
from typing import List, Optional

from . import render
from .trace import RoundPoint, Trace

PHASES = ("draft", "verify", "rollback", "commit")


def frames(trace: Optional[Trace]) -> int:
    """How many frames the replay of `trace` has (0 without drafting rounds)."""
    return len(trace.rounds) * len(PHASES) if trace else 0


def _drafts(trace: Trace, r: RoundPoint, phase: int) -> str:
    """The round's drafts after the committed text, marked as the phase has judged them."""
    out: List[str] = []
    for i, d in enumerate(r.drafts):
        if phase == 0:
            state = "proposed"
        else:
            state = "kept" if i < r.accepted else "refused" if i == r.accepted else "unchecked"
            if phase >= 2 and state != "kept":
                continue  # rolled back
        out.append(f'<span class="replay-draft {state}" data-state="{state}">{html.escape(trace.piece(d))}</span>')
    return "".join(out)


def _verdicts(trace: Trace, r: RoundPoint) -> str:
    words = []
    for i, d in enumerate(r.drafts):
        mark = "✓ kept" if i < r.accepted else "✗ refused" if i == r.accepted else "– not checked"
        numbers = render._draft_numbers(r, i) if i <= r.accepted else ""
        words.append(f"{html.escape(repr(trace.piece(d)))} {mark}{html.escape(numbers)}")
    return "; ".join(words)


def replay_html(trace: Optional[Trace], frame: int) -> str:
    """The replay at `frame` (clamped): the answer up to the round, the round's drafts in their phase,
    and the four steps with the current one highlighted."""
    n = len(trace.rounds) if trace else 0
    if not n:
        return '<div class="dyno-answer empty">Finish an answer with drafting on, then replay its rounds here.</div>'
    frame = max(0, min(frame, frames(trace) - 1))
    number, phase = frame // len(PHASES) + 1, frame % len(PHASES)
    r = trace.rounds[number - 1]
    kept, refused = r.accepted, len(r.drafts) - r.accepted
    closer = {"correction": "correction: the model's own token replaces the refused draft",
              "bonus": "bonus: every draft was kept, and the same pass gave the model's next token too"}
    steps = [
        f"draft: the MTP head proposes {len(r.drafts)} tokens, one after another",
        f"verify: one pass of the model checks them all: {_verdicts(trace, r)}",
        f"rollback: {refused} refused or unchecked draft{'s' if refused != 1 else ''} discarded, the caches cut back"
        if refused else "rollback: nothing to undo, every draft was kept",
        closer.get(r.closer or "", "the generation stopped inside this round"),
    ]
    items = "".join(f'<li class="{"current" if i == phase else "later" if i > phase else "done"}">{s}</li>'
                    for i, s in enumerate(steps))
    upto = r.first + (r.delivered if phase == 3 else 0)
    tail = "" if phase == 3 else _drafts(trace, r, phase)
    head = (f'<div class="replay-head" data-round="{number}" data-phase="{PHASES[phase]}">Round {number} of {n} · '
            f'{PHASES[phase]} · {kept} of {len(r.drafts)} drafts kept</div>')
    return (f'<div class="dyno-replay">{head}{render.answer_html(trace, upto=upto, tail=tail)}'
            f"<ol>{items}</ol></div>")
