"""Reusing the state of earlier generations when a new prompt shares a prefix with them.

Attention KV caches trim back to any shorter prefix; Gated DeltaNet layers keep one recurrent state
(and a conv window) that cannot be rewound. So an entry keeps, besides its state at its end, exact
*checkpoints* of those layers at positions a later prompt is likely to share: the message
boundaries the caller names and the end of the prompt (prefill is cut there to take them), and the
position its generation resumed from. A new prompt resumes from the longest stored position within
its common prefix with an entry: attention trimmed to it, recurrent states restored from it. Turn
N+1 usually extends turn N's answer (the entry's end); a thinking turn whose <think> text the
template drops, a re-rendered tool call, a regenerate or an edit resume from the last checkpoint
before the point where the prompts part.

The MTP head's cache is kept one row short: the row of position p pairs it with token p+1, which
only the next prompt knows, so an entry (and each checkpoint made while drafting) keeps the trunk
hidden at the last position to build that row. An entry made without drafting serves a drafting
request with a head cache that starts empty at the resume point (ShiftedKVCache): drafts are only
guesses, so output stays exact; a drafting entry serves a plain request by its trunk alone.

The store is bounded by bytes and evicts the least recently used entry (to the disk tier, if
any: disk.py). It runs on the engine thread only.
"""

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from ..backend.memory import default_prompt_cache_bytes, device_memory


RECENT = 4  # the latest checkpoints kept whatever their spacing (regenerate, edit, a dropped <think>)
MIN_GAP = 16  # tokens: a checkpoint closer than this to a later one is not worth its memory

Recurrent = Tuple[Optional[Tuple[mx.array, ...]], ...]  # per trunk layer: a GDN layer's arrays, None for attention


def is_attention(cache) -> bool:
    """Attention KV caches trim (mlx-lm's cache protocol); recurrent (ArraysCache) layers do not."""
    return cache.is_trimmable()


def own_rows(cache):
    """An attention layer extracted from a batch with arrays of its own, cut to its offset (a slice of
    the batch's would keep the whole batch's alive); recurrent layers are copied by `owned`."""
    if isinstance(cache, ShiftedKVCache):
        own_rows(cache.rows)
    elif is_attention(cache) and cache.keys is not None:
        cache.keys = mx.array(cache.keys[..., : cache.offset, :])
        cache.values = mx.array(cache.values[..., : cache.offset, :])
    return cache


def recurrent_state(cache: List[Any]) -> Recurrent:
    """References to every recurrent layer's arrays (MLX arrays are immutable: references are a copy)."""
    return tuple(None if is_attention(c) else tuple(c.cache) for c in cache)


def owned(recurrent: Recurrent) -> Recurrent:
    """Copies to keep: a conv window is a slice of its pass's whole input (a batch row, of the whole
    batch), and a slice kept keeps all of it."""
    return tuple(None if layer is None else tuple(None if a is None else mx.array(a) for a in layer)
                 for layer in recurrent)


@dataclass(eq=False)
class Checkpoint:
    """What trimming attention cannot give back: the recurrent layers after an entry's first `at`
    tokens, and (made while drafting) the trunk hidden at position at-1 for the head's open row."""

    at: int
    recurrent: Recurrent
    hidden: Optional[mx.array] = None  # [1, 1, H]

    def arrays(self) -> Iterator[mx.array]:
        for layer in self.recurrent:
            yield from (a for a in layer or () if a is not None)
        if self.hidden is not None:
            yield self.hidden


class ShiftedKVCache:
    """A head KV cache whose first `start` positions have no rows (its entry was made without
    drafting): RoPE positions stay true, attention sees the rows from `start` on."""

    def __init__(self, start: int, rows: Optional[KVCache] = None):
        self.start = start
        self.rows = rows if rows is not None else KVCache()

    @property
    def offset(self) -> int:
        return self.start + self.rows.offset

    @property
    def keys(self):
        return self.rows.keys

    @property
    def values(self):
        return self.rows.values

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    @property
    def state(self):
        return self.rows.state

    def update_and_fetch(self, keys, values):
        return self.rows.update_and_fetch(keys, values)

    def make_mask(self, *args, **kwargs):
        return self.rows.make_mask(*args, **kwargs)

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:  # mlx-lm's cache protocol: positions held, the absent ones included
        return self.offset

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        from_rows = self.rows.trim(min(n, self.rows.offset))
        self.start -= n - from_rows
        return n

    def prefix(self, n: int) -> "ShiftedKVCache":
        """A copy holding positions 0..n-1 (rows before `start` stay absent)."""
        if n <= self.start:
            return ShiftedKVCache(n)
        return ShiftedKVCache(self.start, kv_prefix(self.rows, n - self.start))


def kv_prefix(cache, n: int):
    """A copy of an attention cache holding its first n positions; writes to it never reach `cache`
    (a slice is a new array, and the next update concatenates into a new buffer)."""
    if isinstance(cache, ShiftedKVCache):
        return cache.prefix(n)
    new = copy.copy(cache)
    if n == 0 or cache.keys is None:
        new.keys = new.values = None
        new.offset = 0
    else:
        new.keys, new.values, new.offset = cache.keys[..., :n, :], cache.values[..., :n, :], n
    return new


def with_arrays(cache, arrays: Tuple[mx.array, ...]):
    """A copy of a recurrent (ArraysCache) layer holding `arrays`."""
    new = copy.copy(cache)
    new.cache = list(arrays)
    if hasattr(new, "left_padding"):
        new.left_padding = new.lengths = None
    return new


def kv_arrays(cache) -> Iterator[mx.array]:
    inner = cache.rows if isinstance(cache, ShiftedKVCache) else cache
    if inner.keys is not None:
        yield inner.keys
        yield inner.values


@dataclass(eq=False)
class Resume:
    """Where a generation starts: caches that consumed the prompt's first `at` tokens."""

    at: int
    trunk_cache: List[Any]
    head_cache: Optional[List[Any]] = None  # rows 0..at-2 (the open row from `hidden`), or shifted
    hidden: Optional[mx.array] = None  # [1, 1, H] trunk hidden at at-1, when the head rows up to there exist
    checkpoints: Dict[int, Checkpoint] = field(default_factory=dict)  # inherited, `at` included

    def __len__(self) -> int:
        return self.at


@dataclass(eq=False)
class PrefixEntry:
    """Caches that have consumed exactly `tokens` (the head, if any, one row short), with
    checkpoints of the recurrent layers at earlier positions."""

    tokens: Tuple[int, ...]
    trunk_cache: List[Any]
    head_cache: Optional[List[Any]] = None  # rows 0..len(tokens)-2 (a ShiftedKVCache lacks the first ones)
    last_hidden: Optional[mx.array] = None  # [1, 1, H] trunk hidden at the last position
    checkpoints: Dict[int, Checkpoint] = field(default_factory=dict)  # position -> state there
    used: int = 0  # the store's clock at its last use
    saved: bool = False  # a file in the disk tier holds exactly this entry

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def ids(self) -> np.ndarray:
        if getattr(self, "_ids", None) is None or len(self._ids) != len(self.tokens):
            self._ids = np.asarray(self.tokens, dtype=np.int64)
        return self._ids

    def positions(self) -> List[int]:
        """Every position a prompt can resume from: the checkpoints and the end."""
        return sorted(set(self.checkpoints) | {len(self)})

    def arrays(self) -> Iterator[mx.array]:
        for c in self.trunk_cache:
            yield from kv_arrays(c) if is_attention(c) else (a for a in c.cache if a is not None)
        for c in self.head_cache or ():
            yield from kv_arrays(c)
        if self.last_hidden is not None:
            yield self.last_hidden
        for cp in self.checkpoints.values():
            yield from cp.arrays()

    def resume(self, at: int, head_layers: int = 0) -> Resume:
        """Copies of the caches at position `at` (a checkpoint or the end); the entry is unchanged.

        `head_layers` > 0: a drafting request, which gets a head cache (shifted where no rows exist).
        """
        end = at == len(self)
        recurrent = recurrent_state(self.trunk_cache) if end else self.checkpoints[at].recurrent
        hidden = self.last_hidden if end else self.checkpoints[at].hidden
        trunk = [kv_prefix(c, at) if r is None else with_arrays(c, r) for c, r in zip(self.trunk_cache, recurrent)]
        head = None
        if head_layers:
            if self.head_cache is not None and hidden is not None:
                head = [kv_prefix(c, at - 1) for c in self.head_cache]
            else:
                head, hidden = [ShiftedKVCache(at) for _ in range(head_layers)], None
        inherited = {p: cp for p, cp in self.checkpoints.items() if p < at}
        inherited[at] = Checkpoint(at, recurrent, hidden)
        return Resume(at, trunk, head, hidden if head_layers else None, inherited)

    def hand_over(self, head_layers: int = 0) -> Resume:
        """The caches themselves at the end (the generation mutates them; the entry is spent)."""
        at = len(self)
        head, hidden = self.head_cache, self.last_hidden
        if head_layers and (head is None or hidden is None):
            head, hidden = [ShiftedKVCache(at) for _ in range(head_layers)], None
        inherited = dict(self.checkpoints)
        inherited[at] = Checkpoint(at, recurrent_state(self.trunk_cache), hidden)
        return Resume(at, self.trunk_cache, head if head_layers else None, hidden if head_layers else None,
                      inherited)


def thin(positions: Iterable[int]) -> List[int]:
    """The checkpoints worth their memory among `positions`: the latest RECENT (at least MIN_GAP
    apart), then ever sparser going back (each at least as far below the next kept one as that
    one is below the latest), and the earliest (a system prompt other conversations share).

    Re-prefilling from the kept checkpoint below a point where two prompts part then costs at
    most about as much again as what lies after that point."""
    desc = sorted({p for p in positions if p > 0}, reverse=True)
    kept: List[int] = []
    for p in desc:
        if not kept:
            kept.append(p)
            continue
        need = MIN_GAP if len(kept) < RECENT else max(MIN_GAP, kept[0] - kept[-1])
        if kept[-1] - p >= need:
            kept.append(p)
    if desc and desc[-1] != kept[-1]:
        kept.append(desc[-1])
    return sorted(kept)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def usable(tokens: np.ndarray, positions: Sequence[int], prompt: np.ndarray) -> int:
    """The longest stored position (0: none) inside the common prefix of `tokens` and `prompt`,
    leaving at least one prompt token to compute the first logits from."""
    limit = min(common_prefix(tokens, prompt), len(prompt) - 1)
    return max((p for p in positions if p <= limit), default=0)


class PrefixCache:
    """Entries of earlier generations, bounded by bytes, least recently used evicted first.

    `take` hands out the caches at the longest usable position of a prompt; `put` keeps the state
    after a generation. `disk` (disk.DiskTier) receives evicted entries and, on `close`,
    live ones, and serves entries it holds when memory has nothing as long.
    """

    def __init__(self, max_bytes: Optional[int] = None, disk=None):
        self.max_bytes = default_budget() if max_bytes is None else max_bytes
        self.disk = disk
        self.entries: List[PrefixEntry] = []
        self._clock = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 or self.disk is not None

    def plan(self, n: int, boundaries: Sequence[int] = (), start: int = 0) -> List[int]:
        """Where to cut the prefill of an n-token prompt resumed at `start` to checkpoint: the
        caller's boundaries (e.g. where each chat message starts) and the end of the prompt (the
        last token stays out: it makes the first logits), thinned."""
        if not self.enabled:
            return []
        marks = {b for b in boundaries if 0 < b < n}
        if not any(n - 1 - b < MIN_GAP for b in marks):
            marks.add(n - 1)  # no boundary near the end (a raw prompt): a regenerate still reuses it
        return [p for p in thin(marks) if p > start]

    def take(self, prompt: Sequence[int], head_layers: int = 0) -> Optional[Resume]:
        """The caches after the longest usable prefix of `prompt`, or None.

        An entry reused at its end goes to the generation (which extends it and puts it back);
        reused at a checkpoint it stays, and the generation gets copies.
        """
        if not self.enabled or len(prompt) < 2:
            return None
        ids = np.asarray(prompt, dtype=np.int64)
        # Longest first; among equals, one with head rows for a drafting request, then the most recent.
        ranked = [((u, bool(head_layers) and e.head_cache is not None, e.used), e)
                  for e in self.entries if (u := usable(e.ids, e.positions(), ids))]
        (at, _, _), best = max(ranked, key=lambda r: r[0], default=((0, 0, 0), None))
        if self.disk is not None and (found := self.disk.best(ids, at)) is not None:
            loaded = self.disk.load(found)
            if loaded is not None and (u := usable(loaded.ids, loaded.positions(), ids)) > at:
                self._keep(loaded)
                best, at = loaded, u
        if best is None:
            return None
        best.used = self._tick()
        if at == len(best) and (head_layers or best.head_cache is None):
            if best in self.entries:
                self.entries.remove(best)
            return best.hand_over(head_layers)
        return best.resume(at, head_layers)

    def put(self, entry: PrefixEntry) -> None:
        """Keep `entry` (its checkpoints thinned), dropping entries it makes redundant, then evict
        the least recently used ones beyond the budget."""
        if not self.enabled or len(entry) == 0:
            return
        keep = set(thin(p for p in entry.checkpoints if p < len(entry)))
        entry.checkpoints = {p: cp for p, cp in entry.checkpoints.items() if p in keep}
        for c, layer in zip(entry.trunk_cache, owned(recurrent_state(entry.trunk_cache))):
            if layer is not None:
                c.cache = list(layer)
        if entry.last_hidden is not None:
            entry.last_hidden = mx.array(entry.last_hidden)  # (a row of its pass's hiddens)
        mx.eval(list(entry.arrays()))
        self.entries = [e for e in self.entries if not _redundant(e, entry)]
        self._keep(entry)

    def _keep(self, entry: PrefixEntry) -> None:
        entry.used = self._tick()
        self.entries.append(entry)
        self._evict()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold (an array several entries share counted once)."""
        return sum(_sizes(self.entries).values())

    def _evict(self) -> None:
        sizes = _sizes(self.entries)
        total = sum(sizes.values())
        while total > self.max_bytes and self.entries:
            victim = min(self.entries, key=lambda e: e.used)
            self.entries.remove(victim)
            still = _sizes(self.entries)
            total -= sum(n for k, n in sizes.items() if k not in still)
            sizes = still
            if self.disk is not None and not victim.saved:
                self.disk.save(victim)

    def close(self) -> None:
        """Write live entries to the disk tier (oldest first), then forget them."""
        if self.disk is not None:
            for e in sorted(self.entries, key=lambda e: e.used):
                if not e.saved:
                    self.disk.save(e)
        self.clear()

    def clear(self) -> None:
        """Forget every entry in memory (frees their caches)."""
        self.entries.clear()


def _redundant(old: PrefixEntry, new: PrefixEntry) -> bool:
    """`new` holds every state `old` offers: old's tokens begin new's, new has a state at old's
    end, and old has no head rows that new lacks."""
    n = len(old)
    return (n <= len(new) and (n == len(new) or n in new.checkpoints)
            and (old.head_cache is None or new.head_cache is not None)
            and common_prefix(old.ids, new.ids) == n)


def _sizes(entries: Sequence[PrefixEntry]) -> Dict[int, int]:
    return {id(a): a.nbytes for e in entries for a in e.arrays()}


def default_budget(model_bytes: int = 0) -> int:
    """The memory budget when none is given, for a model of `model_bytes` (memory.py's share of what it leaves)."""
    return default_prompt_cache_bytes(model_bytes, device_memory())


def entry_from(tokens: Sequence[int], trunk_cache: List[Any],
               checkpoints: Optional[Dict[int, Checkpoint]] = None) -> PrefixEntry:
    """A headless entry from caches that consumed `tokens` (mlx-lm's own decoding, a batch row)."""
    return PrefixEntry(tuple(int(t) for t in tokens), trunk_cache, checkpoints=dict(checkpoints or {}))

