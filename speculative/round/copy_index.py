"""Where a row's latest tokens occurred before in its own context, kept as the context grows.

A table per n-gram size maps each n-gram to the end of its latest occurrence; appending a token
reads the table (where the n-gram now ending occurred before) and then points it at the new end,
so each token costs one lookup and one store per size (amortised O(1)), and asking for the match
reads what the last token found. Pure Python: a row's context is plain token ids.

Measured against a suffix automaton (tools/copy_index_bench.py): the automaton finds matches of any
length but costs more per token in Python and knows only some occurrence, not the latest one.
"""

from typing import List, NamedTuple, Optional, Sequence

SIZES = (8, 4, 3)  # n-gram sizes tried, longest first; the last is the shortest match copied (3: measured, docs/performance.md)


class Match(NamedTuple):
    """The longest of the index's n-grams ending the context that also ended earlier: its size and
    where its latest earlier occurrence ends."""

    size: int
    end: int


class ContextIndex:
    """The n-grams of one growing token sequence (a row's prompt, then what it generated), each
    pointing at the end of its latest occurrence."""

    def __init__(self, sizes: Sequence[int] = SIZES):
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"n-gram sizes must be integers >= 1, got {sizes!r}")
        self.sizes = sorted(set(sizes), reverse=True)
        self.tokens: List[int] = []
        self._latest = [{} for _ in self.sizes]  # per size: n-gram -> end index of its latest occurrence
        self._before: List[Optional[int]] = [None] * len(self.sizes)  # per size: where the last n-gram ended before

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the context, indexing each n-gram they end."""
        mine = self.tokens
        for t in tokens:
            mine.append(int(t))
            i = len(mine)
            for s, n in enumerate(self.sizes):
                if i < n:
                    self._before[s] = None
                    continue
                key = tuple(mine[i - n : i])
                table = self._latest[s]
                self._before[s] = table.get(key)
                table[key] = i - 1

    def match(self) -> Optional[Match]:
        """The longest indexed n-gram ending the context that occurred before (its latest earlier
        occurrence), or None."""
        for n, end in zip(self.sizes, self._before):
            if end is not None:
                return Match(n, end)
        return None

    def proposal(self, k: int, match: Optional[Match] = None) -> List[int]:
        """Up to k tokens that followed the match's occurrence: what the context would say next if it
        repeats itself there. A match close to the end copies what it is copying (as LZ77 does), so a
        run that repeats a short pattern proposes the pattern again."""
        match = match or self.match()
        if match is None or k <= 0:
            return []
        src, out = self.tokens, []
        n = len(src)
        for m in range(k):
            p = match.end + 1 + m
            out.append(src[p] if p < n else out[p - n])
        return out
