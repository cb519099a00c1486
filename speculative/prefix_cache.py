"""Reusing the state of earlier generations when a new prompt starts with their tokens.

Gated DeltaNet layers keep one recurrent state that cannot be trimmed, so an entry is reused only
when its whole token sequence is a prefix of the new prompt (multi-turn chat: turn N's prompt is
turn N-1's prompt and answer plus the new message). Entries are saved at the end of a generation,
settled to exactly the tokens the caller received, so the next turn prefills only what is new.

An entry holds the trunk cache after its tokens and, for speculative runs, the head cache one row
short: the head's row for the last position pairs it with the token that follows, which only the
next prompt knows, so the entry keeps that position's trunk hidden to build the row on reuse.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx


@dataclass
class PrefixEntry:
    """Caches that have consumed exactly `tokens` (the head, if any, one row short)."""

    tokens: Tuple[int, ...]
    trunk_cache: List[Any]
    head_cache: Optional[List[Any]] = None  # rows 0..len(tokens)-2
    last_hidden: Optional[mx.array] = None  # [1, 1, H] trunk hidden at the last position

    def __len__(self) -> int:
        return len(self.tokens)


class PrefixCache:
    """A few entries, most recently used last; an entry is handed out once (its caches mutate)."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self.entries: List[PrefixEntry] = []

    def take(self, prompt: Sequence[int], with_head: bool) -> Optional[PrefixEntry]:
        """Remove and return the longest entry that is a strict prefix of `prompt`, or None.

        Strict: at least one prompt token must be left to produce the first logits.
        """
        prompt = tuple(prompt)
        fits = [
            e for e in self.entries
            if len(e) < len(prompt) and prompt[: len(e)] == e.tokens
            and (e.head_cache is not None or not with_head)
        ]
        if not fits:
            return None
        best = max(fits, key=len)
        self.entries.remove(best)
        return best

    def put(self, entry: PrefixEntry) -> None:
        """Keep `entry`, evicting the least recently used beyond capacity."""
        self.entries.append(entry)
        del self.entries[: -self.capacity]

    def clear(self) -> None:
        """Forget every entry (frees their caches)."""
        self.entries.clear()
