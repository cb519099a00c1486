"""A guard against a head whose drafts silently fail: output stays exact, drafting becomes useless.

A broken head (norms shifted twice, random weights, a wrong format) is still exact, since every
draft is verified, so nothing but a low acceptance shows it. The monitor watches a loaded model's
first drafts, across requests, and gives one verdict. It counts only drafts at positions where the
target was confident (its own top token at probability >= verify.CONFIDENT), so a working head is not
judged at positions nobody could guess, as at a high temperature; and only drafts the target judged
after the committed tokens (those up to the first rejection: the rest followed a refused draft).
"""

import threading
from typing import Optional

WINDOW = 64  # confident drafts the verdict is taken over
FLOOR = 0.05  # acceptance below this over the window: collapsed (working heads accept far more)


class HeadHealth:
    """One loaded head's health: "checking" until WINDOW confident drafts were seen, then "ok" or
    "collapsed" for good. Fed each Round (with its `confident` flags) by whoever consumes the events."""

    def __init__(self, window: int = WINDOW, floor: float = FLOOR):
        self.window, self.floor = window, floor
        self.drafted = 0  # confident drafts seen while checking
        self.accepted = 0  # of them, accepted
        self.status = "checking"
        self._lock = threading.Lock()  # /stats reads from another thread than the engine's

    @property
    def checking(self) -> bool:
        return self.status == "checking"

    @property
    def collapsed(self) -> bool:
        return self.status == "collapsed"

    def observe(self, event) -> bool:
        """Count one round's confident drafts; True when this round settles the verdict."""
        if not self.checking or not event.confident or event.source != "head":  # copies say nothing of the head
            return False
        judged = min(event.accepted + 1, event.drafted)  # drafts 0..accepted: the first rejection included
        flags = event.confident[:judged]
        with self._lock:
            self.drafted += sum(flags)
            self.accepted += sum(flags[: event.accepted])
            if self.drafted < self.window:
                return False
            self.status = "collapsed" if self.accepted < self.floor * self.drafted else "ok"
        return True

    def as_json(self) -> dict:
        """The `head` object of /stats."""
        with self._lock:
            return {"status": self.status, "confident_drafts": self.drafted, "accepted": self.accepted}


def collapse_notice(lm, health: HeadHealth, mode: str) -> str:
    """The one line that says a loaded head collapsed: its source, precision and norm decision, and
    what drafting does now (`auto` stops, `mtp` goes on)."""
    memory = lm.head_memory
    precision = memory.precision if memory is not None else "unknown precision"
    norms = getattr(lm, "norm_decision", None)  # what the loader decided about the +1 norm shift, if it did
    then = ("decoding without drafts from now on" if mode == "auto"
            else "still drafting, as --speculative mtp asks")
    return (f"dyno: warning: the MTP head from {lm.head_source} ({precision}, norms: {norms or 'as stored'}) "
            f"had {health.accepted} of {health.drafted} drafts accepted where the model was confident; "
            f"a working head has most accepted, so it is likely broken (output stays exact); {then}")


def watch(lm, event, mode: str) -> None:
    """Feed `lm`'s head health one Round; the collapse notice (lm.note) when it settles on collapsed."""
    health = lm.head_health
    if health is not None and health.observe(event) and health.collapsed:
        lm.note(collapse_notice(lm, health, mode))


def gives_up(lm, mode: str) -> bool:
    """True when `mode` "auto" stops drafting for `lm`: its head was found collapsed."""
    return mode == "auto" and lm.head_health is not None and lm.head_health.collapsed
