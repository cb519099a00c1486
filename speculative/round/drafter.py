"""The drafter seam: where a round's proposed tokens come from.

A drafter is asked, before each round, for every row's drafts within that row's budget; it returns
each row's tokens (ragged: any length from 0 to its budget) and, for a sampled row, the draft
distribution q each token was proposed from (a token proposed deterministically, a copy say, has a
one-hot q). The round verifies what it is given by each row's own rule (row.Row.accept), so any
drafter keeps the output exact: a bad one only costs speed. The MTP head is one drafter; replayed
drafts for benchmarks and the tests' adversarial drafters are others, and all of them run at any
width (vLLM draws the same line: a proposer returns draft ids per request).
"""

from typing import List, NamedTuple, Optional, Protocol, Sequence

import mlx.core as mx


class Drafts(NamedTuple):
    """A round's proposals: row b's first lengths[b] tokens of tokens[b] are its drafts."""

    tokens: mx.array  # [B, k] with k >= max(lengths); columns past a row's length are never verified for it
    probs: List[Optional[mx.array]]  # row b's [k, V] draft distribution q, None for a greedy row
    lengths: List[int]
    sources: Optional[List[str]] = None  # row b's drafts came from "head" or "copy" (None: all the head's)


class Drafter(Protocol):
    """Proposes each row's drafts for the next round."""

    def propose(self, rounds, budgets: Sequence[int]) -> Drafts:
        """Drafts for `rounds.rows` (round.Rounds: its rows, caches and head outputs, each row's
        `generated` ending with the token the drafts follow), row b at most budgets[b] of them.

        A drafter that draws draws with the row's own key (Row.split, Row.pick), which the driver
        restores when it takes queued drafts back, so a join or a leave never changes a token."""
        ...


def reach(drafter: Drafter, rows, budgets: Sequence[int]) -> List[int]:
    """Each row's most drafts this round: the depth policy's `budgets`, or what the drafter's optional
    `reach(rows, budgets)` allows instead (copies run deeper than the head; round/copies.py)."""
    reaches = getattr(drafter, "reach", None)
    return list(budgets) if reaches is None else list(reaches(rows, budgets))


def refusal(drafter: Drafter, params) -> Optional[str]:
    """Why `drafter` cannot draft for a row with these SamplingParams (its optional `refuses(params)`), or None."""
    refuses = getattr(drafter, "refuses", None)
    return refuses(params) if refuses is not None else None


class HeadDrafter:
    """The MTP head chained on its own outputs (Rounds.draft_rows): every row as deep as its budget.
    `projection`: its draft step's rows (a DraftLMHead) instead of the round's own."""

    def __init__(self, projection=None):
        self.projection = projection

    def propose(self, rounds, budgets: Sequence[int]) -> Drafts:
        tokens, probs = rounds.draft_rows(max(budgets), self.projection)
        return Drafts(tokens, probs, list(budgets))


def drafts_of(drafter: Drafter, rounds, budgets: Sequence[int]) -> Drafts:
    """`drafter`'s proposals, checked: lengths within budgets and the tokens array wide enough."""
    out = drafter.propose(rounds, budgets)
    if len(out.lengths) != len(budgets) or any(not 0 <= n <= b for n, b in zip(out.lengths, budgets)):
        raise ValueError(f"a drafter proposed {out.lengths} drafts for budgets {list(budgets)}")
    if out.tokens.ndim != 2 or out.tokens.shape[1] < max(out.lengths, default=0):
        raise ValueError(f"a drafter's tokens have shape {out.tokens.shape} for lengths {out.lengths}")
    return out


def one_hot(tokens: Sequence[int], vocab: int) -> mx.array:
    """[k, V] draft distributions of tokens proposed with certainty (the lossless rule then accepts
    token x with p(x), else draws from p with x removed)."""
    return (mx.arange(vocab)[None] == mx.array(list(tokens), dtype=mx.int32)[:, None]).astype(mx.float32)


def stacked(rows: List[List[int]], width: int, pad: int = 0) -> mx.array:
    """Per-row token lists as one [B, width] uint32 array, padded with `pad`."""
    return mx.array([r + [pad] * (width - len(r)) for r in rows], dtype=mx.uint32)
