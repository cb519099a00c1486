"""A row's state settled to the tokens its consumer received: what a prompt cache keeps for the
request's next turn.

The consumer may stop inside a round (EOS, max_tokens or a stop string before its last token, a
cancel right after its Round event), leaving the caches with committed tokens nobody received; the
latest pass's tapes restore any prefix of it. The last emitted token stays out, as the pending
token always does.
"""

from typing import Dict, List, NamedTuple, Optional

import mlx.core as mx

from ..errors import DynoError
from ..prompt_cache.store import Checkpoint, PrefixEntry, own_rows
from ..rollback import GDNTape, rollback
from ..round.rounds import trim_to
from ..round.row import Row


class LastPass(NamedTuple):
    """A row's latest trunk pass, kept so that `settled` can roll its caches back to any emitted token."""

    tapes: Optional[List[GDNTape]]  # what its GDN layers saw; None or empty: only all `committed` settle
    hidden: mx.array  # [1, T, H] trunk hiddens of the tokens it fed
    committed: int  # how many of those tokens were kept
    before: Optional[mx.array] = None  # [1, 1, H] trunk hidden of the token before its first one


def settled(prompt: List[int], generated: List[int], emitted: int, trunk: List, head: Optional[List],
            last: LastPass, checkpoints: Dict[int, Checkpoint]) -> PrefixEntry:
    """One row's caches (holding `prompt` and `generated` but the last, `last` the pass that fed the
    latest of them) settled to the prompt and the first `emitted` tokens minus the last; `head`
    (None: none kept) holds a row per trunk position."""
    tapes, hidden, committed, before = last
    keep = committed - (len(generated) - emitted)  # of the last pass's tokens
    # The caches hold `committed` tokens of that pass; the tapes restore any prefix of it.
    rollback(trunk, tapes or [], fed=committed, consumed=keep)
    tokens = tuple(prompt + generated[: emitted - 1])
    last_hidden = hidden[:, keep - 1 : keep] if keep else before
    if head is not None:  # one row short: that row pairs the last position with the next token
        trim_to(head, len(tokens) - 1)
    head = head if last_hidden is not None else None  # no hidden: its open row cannot be built
    return PrefixEntry(tokens, trunk, head, last_hidden, {p: cp for p, cp in checkpoints.items() if p < len(tokens)})


class Leaving:
    """A row that left the batch: its own caches (extracted) and its latest pass, on them (tapes of
    its own rows, its hiddens), to be settled once."""

    def __init__(self, row: Row, trunk: List, head: Optional[List], last: LastPass):
        self.row, self.trunk, self.head, self.last = row, trunk, head, last

    def settle(self, emitted: int) -> PrefixEntry:
        """The row's state after its prompt and first `emitted` tokens minus the last (the pending
        one). Once only: it lets go of the caches and the pass (their tapes hold the whole round's states)."""
        row, last, trunk, head = self.row, self.last, self.trunk, self.head
        self.trunk = self.head = self.last = None
        if last is None:
            raise DynoError("a leaving row's state was already settled")
        keep = last.committed - (len(row.generated) - emitted)
        if keep < (0 if last.before is not None else 1) or (keep < last.committed and last.tapes is None):
            raise DynoError(f"a leaving row cannot be settled to {emitted} of its {len(row.generated)} tokens")
        entry = settled(row.cache_key or row.prompt, row.generated, emitted, trunk, head, last, row.checkpoints)
        entry.trunk_cache = [own_rows(c) for c in entry.trunk_cache]  # not slices of the batch's arrays
        entry.head_cache = entry.head_cache and [own_rows(c) for c in entry.head_cache]
        return entry
