"""Drafts copied from a row's own context, and the drafter that takes them where a long enough match
exists and the MTP head's drafts elsewhere.

Much of what people run repeats what it was given (an edited file, a quoted function, a filled
template): where the row's latest tokens occurred before in its prompt or output (copy_index.py),
what followed there is a likely continuation, proposed with certainty (a one-hot q, so the lossless
rule keeps copy x with probability p(x) and otherwise draws from p with x removed; greedy and seeded
rows keep it while it equals the trunk's token). Verification decides the output as for any drafter.

A copy can run deeper than the head's depth (up to COPY_CAP): the driver asks `reach` for each row's
budget this round, which is the depth policy's for a row the head drafts. Each row's copy length
adapts to how its last copy fared, so a row whose copies keep breaking verifies few extra positions.
"""

import weakref
from typing import List, Optional, Sequence

import mlx.core as mx

from ..config import COPY_SOURCES
from .copy_index import SIZES, ContextIndex
from .drafter import Drafts, one_hot

COPY_CAP = 16  # the most tokens a round copies
FIRST_COPY = 8  # a row's first copy length; doubled while copies hold, cut to what held when one breaks
MIN_COPY = 2


def check_source(copies: str) -> str:
    """`copies` if it is one of COPY_SOURCES (drafts from copies and the head, the head alone, copies
    alone), else a one-line error."""
    if copies not in COPY_SOURCES:
        raise ValueError(f"copies must be one of {', '.join(COPY_SOURCES)}, got {copies!r}")
    return copies


class RowCopies:
    """One row's copy state: the index of its context and how far its next copy reaches."""

    def __init__(self, sizes: Sequence[int]):
        self.index = ContextIndex(sizes)
        self.length = FIRST_COPY
        self.last: Optional[tuple] = None  # (len(generated) when proposed, the tokens copied)

    def catch_up(self, row) -> None:
        """Index the row's tokens not seen yet (its prompt first: built at its first round after a
        join, so a row resumed from the prompt cache needs nothing kept), and learn from the last copy."""
        seen, prompt = len(self.index), len(row.prompt)
        if seen < prompt:
            self.index.extend(row.prompt[seen:])
            seen = prompt
        self.index.extend(row.generated[seen - prompt :])
        if self.last is not None and len(row.generated) > self.last[0]:
            at, copied = self.last
            got = row.generated[at : at + len(copied)]
            held = next((i for i, (c, g) in enumerate(zip(copied, got)) if c != g), len(got))
            if held == len(copied):  # the copy held throughout: reach further
                self.length = min(COPY_CAP, 2 * self.length)
            else:  # it broke after `held` tokens: the next one reaches as far as this one held
                self.length = max(MIN_COPY, held + 1)
            self.last = None


class CopiesAndHead:
    """Per row and round: a copy from the row's context where one matches (see module docstring),
    else the MTP head's drafts (Rounds.draft_rows, run only as deep as the rows it drafts need).

    `copies`: "on" (both), "off" (the head alone: exactly HeadDrafter) or "only" (copies alone; a
    row with no match drafts nothing); a row's own `copies` (Row.copies, set by its request)
    overrides it. `projection`: the head's draft step rows (a DraftLMHead) instead of the round's."""

    def __init__(self, copies: str = "on", projection=None, sizes: Sequence[int] = SIZES, cap: int = COPY_CAP):
        self.copies = check_source(copies)
        self.projection, self.sizes, self.cap = projection, tuple(sizes), cap
        self._rows = weakref.WeakKeyDictionary()  # Row -> RowCopies: a row's index goes when the row does

    def source(self, row) -> str:
        return getattr(row, "copies", None) or self.copies

    def _copy(self, row, budget: int) -> Optional[List[int]]:
        """The tokens row would copy this round (None: it does not copy), given its budget from the depth
        policy (0: the row does not draft at all this round)."""
        if budget <= 0 or self.source(row) == "off":
            return None
        state = self._rows.get(row)
        if state is None:
            state = self._rows[row] = RowCopies(self.sizes)
        state.catch_up(row)
        match = state.index.match()
        # Drafts past the row's last token are never emitted: its round gives accepted drafts + 1 tokens.
        n = min(self.cap, state.length, row.params.max_tokens - len(row.generated) - 1)
        if match is None or n <= 0:
            return None
        return state.index.proposal(n, match)

    def reach(self, rows, budgets: Sequence[int]) -> List[int]:
        """Each row's draft budget this round: its copy's length where it copies, else the policy's. With
        other rows beside it a copy stays within the policy's budget: every row of a round is verified
        as wide as the widest (dyno-tiny, 4 clients: the server ran at 0.79x batched plain decoding
        with copies reaching past it, 0.99x without copies; tools/serve_concurrency.py)."""
        out = []
        for row, b in zip(rows, budgets):
            copied = self._copy(row, b)
            out.append(b if copied is None else len(copied) if len(rows) == 1 else min(len(copied), b))
        return out

    def propose(self, rounds, budgets: Sequence[int]) -> Drafts:
        rows = rounds.rows
        copies = [self._copy(r, b) for r, b in zip(rows, budgets)]
        copies = [c[:b] if c is not None else None for c, b in zip(copies, budgets)]
        heads = [c is None and self.source(r) != "only" for r, c in zip(rows, copies)]
        lengths = [len(c) if c is not None else b if h else 0 for c, b, h in zip(copies, budgets, heads)]
        k_head = max((b for b, h in zip(budgets, heads) if h), default=0)
        width = max(lengths, default=0)
        vocab = rounds.lm.vocab_size
        for r, c in zip(rows, copies):
            if c is not None:
                self._rows[r].last = (len(r.generated), c)
        if k_head:  # one head pass per position over every row: a copying row's head drafts go unused
            head_tokens, head_probs = rounds.draft_rows(k_head, self.projection)
            if all(heads):
                return Drafts(head_tokens, head_probs, lengths, ["head"] * len(rows))
            head_tokens = mx.pad(head_tokens, [(0, 0), (0, width - k_head)])
        else:
            head_tokens, head_probs = None, [None] * len(rows)
        copied = mx.array([(c or []) + [0] * (width - len(c or [])) for c in copies], dtype=mx.uint32)
        if head_tokens is not None:
            copied = mx.where(mx.array([c is not None for c in copies])[:, None], copied.astype(head_tokens.dtype),
                              head_tokens)
        probs = [None if r.params.greedy else one_hot(c, vocab) if c is not None else
                 head_probs[b] if h else one_hot([], vocab) for b, (r, c, h) in enumerate(zip(rows, copies, heads))]
        sources = ["copy" if c is not None else "head" for c in copies]
        return Drafts(copied, probs, lengths, sources)
