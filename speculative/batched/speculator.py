"""The one driver: B >= 1 rows, each its own request, share one draft step per position and one
trunk pass per round (round.Rounds); acceptance, rollback, RNG, stopping and a pinned depth stay per
row (row.Row). Drafts come from the driver's drafter (round/drafter.py: the MTP head unless told
otherwise). decoding.Decoding runs it with each row's life around it (prefix reuse, depth, settling)
for engine.generate (width 1) and the server's drafting worker (any width).

Rows that join together are prefilled together (prefill.py: right-padded as mlx-lm's BatchGenerator
does, each after its own resumed prefix) and then join: their attention caches are rows of mlx-lm
BatchKVCaches (left padding, a RoPE offset per row), their Gated DeltaNet caches rows of ArraysCaches
(no pad token ever enters a recurrent state). Rows leave between rounds. Rollback is exact per row:
a row's rejected KV slots are rolled into its own left padding, where the mask hides them (a zeroed
key would still add e^0 to the softmax denominator), and its GDN state is taken from its own
position on the verify tape. An image prompt's row sits at its own M-RoPE positions beside text rows
(target.RowsRoPE); a model split across processes runs one row at a time.

A row that leaves (EOS or max_tokens in a round, a stop string or a cancel between rounds) hands
back its own caches and its latest pass (settle.Leaving), which settle to the tokens its consumer
received: the state a prompt cache keeps for the request's next turn.

Depth 0 is a plain batched round: the trunk alone over each row's pending token, no Round event
(a round that drafts nothing is not a drafting round; a row not pinned at 0 gets a Parked), the head's rows deferred until drafting resumes.
Each round queues the next one's first work before it hands its tokens out, so the device computes
while the host works: for a plain round next, its pass (as mlx-lm's BatchGenerator does), for a
drafting round next, its drafts, at the depth the caller says comes next. A join, a leave or a
round at another depth first takes that work back (the caches rewound, the RNG keys restored), so
it never changes a token.
"""

import logging
from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from ..rollback import GDNTape, restore, snapshot, tape_row
from ..round.drafter import Drafter, Drafts, HeadDrafter, drafts_of, reach, refusal
from ..round.rounds import Rounds
from ..round.row import Row
from ..config import SamplingParams
from .prefill import PREFILL_STEP, Joiner, prefill_groups, prefill_together
from .settle import LastPass, Leaving
from ..errors import DynoError
from ..events import Parked, Provenance, Round, Token
from ..loader import LoadedModel
from ..backend.memory import MLX_MEMORY, Memory
from ..prompt_cache.store import Resume, ShiftedKVCache
from ..round.sampling import log_softmax

log = logging.getLogger(__name__)

# Depth-0 rounds owe the head this many rows at most before it runs over them in one pass: the
# trunk hiddens they hold stay small, and drafting, when it resumes, starts from a short catch-up.
HEAD_BACKLOG = 32


def rows_rope(rows: Sequence[Row]):
    """The positions of a batch of `rows`: None when no row has an image (mlx-lm's own layers run),
    else each row at its own (target.MRoPE.beside)."""
    image = next((r.rope for r in rows if r.rope is not None), None)
    return None if image is None else image.beside([r.rope for r in rows])


# ---- the caches, row by row ----

def as_batch(cache: List) -> List:
    """A one-row cache list (KVCache, ShiftedKVCache, ArraysCache) as one-row batch caches."""
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            out.append(BatchKVCache.merge([c]))
        elif isinstance(c, ShiftedKVCache):  # a head without its first rows: RoPE positions stay true
            rows = BatchKVCache.merge([c.rows])
            rows.offset = rows.offset + c.start
            out.append(rows)
        elif isinstance(c, ArraysCache):
            rows = ArraysCache(len(c.cache))  # no left padding: the row's state is its own tokens only
            rows.cache = list(c.cache)
            out.append(rows)
        else:
            raise DynoError(f"batched drafting cannot hold a {type(c).__name__}")
    return out


def extend(batch: List, rows: List) -> None:
    """Append the rows of `rows` (batch caches) to `batch`, layer by layer."""
    for mine, theirs in zip(batch, rows):
        mine.extend(theirs)


def own_head(row: Row, head: List, b: int) -> List:
    """Row b's head caches out of the batch's; a row that joined with a head lacking its first rows
    (an entry made without drafting) gets them back as absent (ShiftedKVCache)."""
    rows = [c.extract(b) for c in head]
    return [ShiftedKVCache(row.head_shift, h) for h in rows] if row.head_shift else rows


def keep_rows(batch: List, indices: List[int]) -> None:
    """Keep only the rows at `indices` of every cache in `batch`."""
    index = mx.array(indices)
    for c in batch:
        c.filter(index)


# ---- the speculator ----

class RowPass(NamedTuple):
    """A row's latest trunk pass (its join's prefill, a plain pass or a verify pass): what settles
    the row, as it leaves, to fewer of its tokens than the caches hold (engine.LastPass)."""

    tapes: Optional[List[GDNTape]]  # the verify pass's; None: only all `kept` can be settled to
    hidden: mx.array  # [B', T, H] trunk hiddens of the pass's rows
    kept: int  # of the pass's T tokens, how many the row's caches hold
    at: int  # the row's index in that pass
    before: Optional[mx.array] = None  # [1, 1, H] the row's trunk hidden before the pass's first token


class RowEvents(NamedTuple):
    """What one row emitted in a join or a round, and why it finished (None: it goes on)."""

    events: List[Union[Round, Token]]
    finish: Optional[str] = None  # "stop" (EOS) or "length" (max_tokens)
    left: Optional[Leaving] = None  # a row that finished: its state, to settle
    error: Optional[BaseException] = None  # a joiner that failed alone (its processors raised)


class PlainPass(NamedTuple):
    """A depth-0 pass, queued: each row's next token, the trunk hiddens the head owes rows for, the
    processed logits, and what rewinds it (the trunk caches before it, the rows' RNG keys)."""

    nxt: mx.array  # [B]
    hidden: mx.array  # [B, 1, H]
    processed: object  # [B, 1, V] logits, or per row [1, V]
    caches: list
    keys: List[mx.array]


class QueuedDrafts(NamedTuple):
    """The next drafting round's drafts, queued: the depth they were asked at, the drafter's
    proposals, and what takes them back (the head caches' size before the draft recursion, the
    rows' RNG keys)."""

    budgets: List[int]  # each row's depth they were asked at
    drafts: Drafts
    head_start: int
    keys: List[mx.array]


class BatchSpeculator(Rounds):
    """Rows of speculative generation drafted and verified together (round.Rounds, on batch caches);
    rows join and leave between rounds.

    Each request's own state is its Row (prompt, generated tokens, sampling parameters, processors,
    RNG, pinned depth); the caches, pending tokens and head hiddens of all rows live here, row b of
    each batch array belonging to self.ids[b].
    """

    def __init__(self, lm: LoadedModel, prefill_step: int = PREFILL_STEP, draft_vocab: Optional[int] = None,
                 memory: Memory = MLX_MEMORY, keep_states: bool = True, drafter: Optional[Drafter] = None,
                 clear_per_rounds: bool = True):
        """`keep_states`: a row that leaves hands back its state (Leaving) to settle; False (no prompt
        cache to keep it in): it leaves nothing, and nothing is held for it. `drafter`: where drafts
        come from (round/drafter.py; default the MTP head). `clear_per_rounds` False: the caller clears
        MLX's buffer cache on its own cadence (a single generation: generate_step's, by tokens)."""
        if lm.head is None:
            raise DynoError("batched drafting needs an MTP head")
        super().__init__(lm, draft_vocab, memory)  # rows clear MLX's buffer cache after each prefill chunk
        self.lm, self.prefill_step, self.draft_vocab, self.keep_states = lm, prefill_step, draft_vocab, keep_states
        self.drafter = drafter if drafter is not None else HeadDrafter()
        self.clearing = memory.per_rounds() if clear_per_rounds else None  # every 512 rounds, as BatchGenerator
        self.ids: List[Hashable] = []  # row b's request
        self.rows: List[Row] = []  # row b's own state
        # Split across processes (one row at a time): each sync is the ranks' one collective, rank 0's
        # outcome for every rank; the head's health is not checked there.
        self.ranks = lm.ranks
        self.health = lm.head_health if self.ranks is None else None
        self.trunk_cache: List = []  # batch caches, one per trunk layer
        self.head_cache: List = []  # batch caches, one per head layer
        self.pending: Optional[mx.array] = None  # [B] each row's emitted token the trunk has not seen
        self.head_hidden: Optional[mx.array] = None  # [B, 1, H] head output of each row's last committed row
        # Head rows owed by depth-0 rounds, run in one pass when drafting resumes (or a row joins):
        # per round ([B, 1] tokens, [B, 1, H] trunk hiddens), row b's pair = (token after position p, h_p).
        self.backlog: List[Tuple[mx.array, mx.array]] = []
        self.ahead: Optional[PlainPass] = None  # the next plain round's pass, queued by this one
        self.queued: Optional[QueuedDrafts] = None  # the next drafting round's drafts, queued by this one
        self.passes: List[RowPass] = []  # row b's latest trunk pass, to settle it by as it leaves

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, row_id: Hashable) -> bool:
        return row_id in self.ids

    def join(self, row_id: Hashable, prompt: Sequence[int], params: SamplingParams,
             resume: Optional[Resume] = None, cuts: Sequence[int] = (), depth: Optional[int] = None,
             details: bool = False, **more) -> RowEvents:
        """One row joins (join_all; `more`: Joiner's other fields): returns its first token."""
        out = self.join_all([Joiner(row_id, prompt, params, resume, cuts, depth, details, **more)])[row_id]
        if out.error is not None:
            raise out.error
        return out

    def join_all(self, joiners: Sequence[Joiner]) -> Dict[Hashable, RowEvents]:
        """Prefill the joiners' prompts together (prefill.py: each after its resumed prefix; a prompt
        much longer than the others in a pass of its own), then add their rows to the batch; returns
        each one's first token. A row that ends at its first token never joins; one whose
        processors raise there, or whose prefill fails alone, gets its error (RowEvents.error) and
        never joins. A joiner's resumed caches are copied, never changed.
        Its `depth` pins its draft depth (0: it never drafts), whatever the rounds' depth is;
        `details`: its Rounds carry each draft's p, q and acceptance chance (the playground's viewer)."""
        ids = [j.row_id for j in joiners]
        if len(set(ids)) < len(ids) or any(i in self.ids for i in ids):
            raise DynoError(f"rows {ids!r} are already in the batch")
        if any(len(j.prompt) == 0 for j in joiners):
            raise DynoError("the prompt is empty")
        if self.ranks is not None and len(self.ids) + len(joiners) > 1:
            raise DynoError("split across processes, requests are decoded one at a time")
        if why := next((w for j in joiners if (w := refusal(self.drafter, j.params))), None):
            raise DynoError(why)
        return {row_id: out for group in prefill_groups(joiners) for row_id, out in self._joined(group).items()}

    def _joined(self, group: Sequence[Joiner]) -> Dict[Hashable, RowEvents]:
        """The group joined together; if that fails (memory, say), row by row, a row that still fails
        getting its error: no request is lost to another's."""
        try:
            return self._join_group(group)
        except Exception as e:
            if len(group) == 1:
                return {group[0].row_id: RowEvents([], error=e)}
            log.exception("a shared prefill failed: its rows join one by one")
            return {row_id: out for j in group for row_id, out in self._joined([j]).items()}

    def _join_group(self, joiners: Sequence[Joiner]) -> Dict[Hashable, RowEvents]:
        """Prefill `joiners` in one padded pass and add those that go on to the batch."""
        # Resumed rows first: a fresh row's recurrent cache holds no arrays yet, and mlx-lm's
        # ArraysCache.extend sizes the zeros it fills in by the arrays it has (else it counts 1 row).
        joiners = sorted(joiners, key=lambda j: j.resume is None)
        self._delivered()  # (before the prefill: the tapes' memory is free for it)
        rows = []
        for j in joiners:
            row = Row(j.params, self.lm.eos_token_ids, self.lm.vocab_size, j.depth, j.rng_seed)
            row.id, row.prompt, row.details, row.copies = j.row_id, list(j.prompt), j.details, j.copies
            head = j.resume.head_cache if j.resume is not None else None
            row.head_shift = head[0].start if head and isinstance(head[0], ShiftedKVCache) else 0
            if j.vision is not None:
                row.rope, row.cache_key = j.vision.rope, list(j.vision.key)
            rows.append(row)
        # The joiners' passes at their positions (an image prompt prefills alone: prefill_groups);
        # the batch's rows at theirs again whatever happens.
        self.rope = rows[0].rope
        try:
            return self._prefilled(joiners, rows)
        finally:
            self.rope = rows_rope(self.rows)

    def _prefilled(self, joiners: Sequence[Joiner], rows: List[Row]) -> Dict[Hashable, RowEvents]:
        trunk, head = self._starting_caches(joiners[0])
        for j in joiners[1:]:
            t, h = self._starting_caches(j)
            extend(trunk, t)
            extend(head, h)
        done = prefill_together(self, joiners, trunk, head, self.prefill_step)
        picks, failed = [], {}
        for b, row in enumerate(rows):
            try:
                logits = row.process(done.logits[b : b + 1])
                picks.append((row.pick_target(logits), logits))
            except Exception as e:  # its processors: this row alone fails
                failed[b] = e
                picks.append(None)
        mx.eval([p[0] for p in picks if p is not None])
        out, staying = {}, []
        for b, (j, row) in enumerate(zip(joiners, rows)):
            if b in failed:
                out[j.row_id] = RowEvents([], error=failed[b])
                continue
            first, logits = picks[b]
            row.generated = [first.item() if self.ranks is None else self.ranks.outcome(first)[0]]
            row.checkpoints = done.checkpoints[b]
            events = RowEvents([Token(row.generated[0], Provenance.PLAIN, row.scored(logits, row.generated)[0])],
                               row.finish(1))
            if events.finish is None:
                staying.append(b)
            elif self.keep_states:  # its caches, to settle: it never joins
                events = events._replace(left=self._joiner_leaving(row, trunk, head, done.hidden, b))
            out[j.row_id] = events
        if not staying:
            return out
        firsts = mx.array([rows[b].generated[0] for b in staying], dtype=mx.uint32)
        index = mx.array(staying)
        if len(staying) < len(joiners):
            keep_rows(trunk + head, staying)
        hidden = done.hidden[index]
        head_hidden = self._head(firsts[:, None], hidden, cache=head)[:, -1:]  # row n-1 drafts position n+1
        self.rope = rows_rope(self.rows)  # the rows already here owe head rows
        self._take_back()
        self._catch_up_head()  # the rows already here owe head rows; the joiners owe none
        if self.ids:
            extend(self.trunk_cache, trunk)
            extend(self.head_cache, head)
            self.pending = mx.concatenate([self.pending, firsts])
            self.head_hidden = mx.concatenate([self.head_hidden, head_hidden])
        else:
            self.trunk_cache, self.head_cache = trunk, head
            self.pending, self.head_hidden = firsts, head_hidden
        for i, b in enumerate(staying):
            self.ids.append(joiners[b].row_id)
            self.rows.append(rows[b])
            self.passes.append(RowPass(None, hidden, 1, i))  # its prefill: one token kept
        return out

    def _starting_caches(self, joiner: Joiner) -> Tuple[List, List]:
        """A joiner's one-row batch caches: its resumed prefix's (the head's open row run), or fresh."""
        r = joiner.resume
        if r is None:
            return as_batch(self.target.make_cache()), as_batch(self.head.make_cache())
        trunk, head = as_batch(r.trunk_cache), as_batch(r.head_cache)  # copies: a retry starts from the same
        if r.hidden is not None:  # the head's row the entry left open: (t_at, h_{at-1})
            self._remember(mx.array(joiner.prompt[r.at : r.at + 1])[None], r.hidden, cache=head)
        return trunk, head

    def _joiner_leaving(self, row: Row, trunk: List, head: List, hidden: mx.array, b: int) -> Leaving:
        """A joiner that ended at its first token: its own caches (the head's without the first
        token's row, which settling drops anyway) and its last prompt token's pass."""
        if any(c.keys is None for c in head):  # a one-token prompt: no head row yet
            return Leaving(row, [c.extract(b) for c in trunk], None, LastPass(None, hidden[b : b + 1], 1))
        heads = own_head(row, head, b)
        n = len(row.prompt)
        return Leaving(row, [c.extract(b) for c in trunk], heads if all(h.offset == n - 1 for h in heads) else None,
                       LastPass(None, hidden[b : b + 1], 1))

    def leave(self, row_id: Hashable) -> Optional[Leaving]:
        """Drop a row (a stop string, a cancel, an error) between rounds; returns its state to settle
        (to as few of the latest round's tokens as its consumer received, until the next join or
        round), or None if it is not here."""
        return self._keep([b for b, i in enumerate(self.ids) if i != row_id]).get(row_id)

    def _keep(self, indices: List[int]) -> Dict[Hashable, Leaving]:
        """Keep only the rows at `indices`; returns the others' states, to settle."""
        if len(indices) == len(self.ids):
            return {}
        self._take_back()  # (the caches hold each row's emitted tokens but its pending one)
        left = {}
        for b in range(len(self.ids)):
            if self.keep_states and b not in indices:
                try:
                    left[self.ids[b]] = self._leaving(b)
                except Exception:  # its state is only for a prompt cache: the row leaves without it
                    log.exception("cannot take a leaving row's state")
        self.ids = [self.ids[b] for b in indices]
        self.rows = [self.rows[b] for b in indices]
        self.passes = [self.passes[b] for b in indices]
        if not indices:
            self.trunk_cache, self.head_cache, self.pending, self.head_hidden = [], [], None, None
            self.backlog, self.rope = [], None
            return left
        keep_rows(self.trunk_cache + self.head_cache, indices)
        self.rope = rows_rope(self.rows)
        index = mx.array(indices)
        self.pending, self.head_hidden = self.pending[index], self.head_hidden[index]
        self.backlog = [(tokens[index], hidden[index]) for tokens, hidden in self.backlog]
        return left

    def _leaving(self, b: int) -> Leaving:
        """Row b's own caches and latest pass (lazy slices: nothing runs unless it is settled)."""
        trunk = [c.extract(b) for c in self.trunk_cache]
        own = {id(c): mine for c, mine in zip(self.trunk_cache, trunk)}  # a tape's layer -> the row's
        p = self.passes[b]
        tapes = None if p.tapes is None else [tape_row(t, p.at, own[id(t.cache)]) for t in p.tapes]
        last = LastPass(tapes, p.hidden[p.at : p.at + 1], p.kept, p.before)
        return Leaving(self.rows[b], trunk, self._head_rows(b), last)

    def _head_rows(self, b: int) -> Optional[List]:
        """Row b's head caches, a row per trunk position (those depth-0 rounds owe it run now, on its
        own copy), or None when it has fewer (it joined with a shifted head: a headless entry)."""
        row = self.rows[b]
        head = own_head(row, self.head_cache, b)
        if any(h.offset + len(self.backlog) != len(row.prompt) + len(row.generated) - 1 for h in head):
            return None
        if self.backlog:
            self._remember(*self._owed(slice(b, b + 1)), cache=head)
        return head

    def _delivered(self) -> None:
        """Every row's consumer has had all its tokens (a join or a round comes next): the rows settle
        to all of them, and the verify tapes go (their memory with them)."""
        self.passes = [p._replace(tapes=None) for p in self.passes]

    def _catch_up_head(self) -> None:
        """Run the head over the rows the depth-0 rounds deferred: every row owes the same count."""
        if self.backlog:
            tokens, hidden = self._owed()
            if tokens.shape[1] > 1:  # only the last row's output is read: it drafts next
                self._remember(tokens[:, :-1], hidden[:, :-1])
            self.head_hidden = self._head(tokens[:, -1:], hidden[:, -1:])
            mx.async_eval(self.head_hidden)
            self.backlog = []

    def _owed(self, rows: slice = slice(None)):
        """The backlog's ([B', T] tokens, [B', T, H] trunk hiddens) for `rows`: the head rows owed."""
        return (mx.concatenate([t[rows] for t, _ in self.backlog], axis=1),
                mx.concatenate([h[rows] for _, h in self.backlog], axis=1))

    def _plain_pass(self, ahead: int = 0) -> PlainPass:
        """Queue depth 0's pass: the trunk over each row's pending token (mlx-lm's own forward), each
        row's token picked by its own rule and key; `ahead`: tokens of each row not yet emitted before
        it (a seeded row draws with its position's key). Nothing is evaluated."""
        caches, keys = snapshot(self.trunk_cache), [r.key for r in self.rows]
        hidden = self.target.hidden(self.pending[:, None], self.trunk_cache, rope=self.rope)  # [B, 1, H]
        logits = self.target.lm_head(hidden)
        if all(r.plain_greedy for r in self.rows):  # one argmax for every row
            nxt, processed = mx.argmax(log_softmax(logits[:, 0]), axis=-1).astype(self.pending.dtype), logits
        else:
            nxt, processed = [], []
            for b, row in enumerate(self.rows):
                rows = row.process(logits[b])
                nxt.append(row.pick_target(rows, ahead)[0].astype(self.pending.dtype))  # argmax, or a draw with the row's key
                processed.append(rows)
            nxt = mx.stack(nxt)
        return PlainPass(nxt, hidden, processed, caches, keys)

    def _take_back(self) -> None:
        """Undo the work queued for the next round, if any: a plain pass (the trunk caches rewound) or
        drafts (the head caches cut back); the RNG keys as they were before it."""
        if self.ahead is not None:
            restore(self.trunk_cache, self.ahead.caches)
            keys, self.ahead = self.ahead.keys, None
        elif self.queued is not None:
            self._trim_head(self.queued.head_start)
            keys, self.queued = self.queued.keys, None
        else:
            return
        for row, key in zip(self.rows, keys):
            row.key = key

    def _queue_drafts(self, depth: int) -> QueuedDrafts:
        """Ask the drafter for the drafts of the next round, at `depth` (each row at its own: depths),
        and start computing them."""
        start, keys, budgets = self.head_cache[0].size(), [r.key for r in self.rows], self.depths(depth)
        drafts = drafts_of(self.drafter, self, reach(self.drafter, self.rows, budgets))  # copies reach deeper
        mx.async_eval(drafts.tokens)
        return QueuedDrafts(budgets, drafts, start, keys)

    def _sync(self, nxt: mx.array, n_acc: mx.array, drafts: mx.array):
        """The round's one host sync; split across processes (one row), the ranks' one collective."""
        if self.ranks is None:
            return super()._sync(nxt, n_acc, drafts)
        next_id, a, drafted = self.ranks.outcome(nxt[0], n_acc[0], drafts[0])
        return [next_id], [a], [drafted]

    def _look_ahead(self, coming: int) -> None:
        """Queue the next plain pass and start it, unless a row's processors wait for tokens not yet
        emitted, or a row ends by its length within the `coming` tokens not yet emitted (its next
        token would be wasted)."""
        if all(not r.processors and len(r.generated) + coming < r.params.max_tokens for r in self.rows):
            self.ahead = self._plain_pass(coming)
            mx.async_eval(self.ahead.nxt)

    def _queue_next(self, then: int) -> None:
        """After a round's tokens are emitted: queue the first work of the next round, at depth `then`."""
        if not self.ids:
            return
        if self.deepest(then) > 0:
            self._catch_up_head()
            self.queued = self._queue_drafts(then)
        else:
            self._look_ahead(0)

    def _plain_round(self, then: int) -> Dict[Hashable, RowEvents]:
        """Depth 0: this round's pass (queued by the last round, or now), and with a plain round next,
        its pass queued behind this one before the one host sync; the head's rows are owed, not run."""
        if self.ranks is not None:  # (ranks would have to agree on each token: generate always drafts)
            raise DynoError("split across processes, every round drafts")
        if self.ahead is None:
            self._take_back()
        now, self.ahead = self.ahead or self._plain_pass(), None
        self.pending = now.nxt
        self.passes = [RowPass(None, now.hidden, 1, b) for b in range(len(self.rows))]
        self.backlog.append((now.nxt[:, None], now.hidden))
        if len(self.backlog) >= HEAD_BACKLOG:
            self._catch_up_head()
        if self.deepest(then) == 0:
            self._look_ahead(1)
        mx.eval(now.nxt)  # the round's one host sync
        out = self._emit([0] * len(self.rows), [1] * len(self.rows), [[] for _ in self.rows], now.nxt.tolist(), now.processed)
        if self.deepest(then) > 0:  # drafts follow the emitted tokens (a row's processors read them)
            self._queue_next(then)
        return out

    def depths(self, depth: int) -> List[int]:
        """Each row's draft depth in a round at `depth`: its pinned one, else its own choice up to
        `depth` (Row.chosen), else `depth`."""
        return [r.depth if r.depth is not None else depth if r.chosen is None else min(depth, r.chosen)
                for r in self.rows]

    def deepest(self, depth: int) -> int:
        """How deep a round at `depth` drafts: as deep as its deepest row (0 with no rows)."""
        return max(self.depths(depth), default=0)

    def step(self, depth: int, then: Optional[int] = None) -> Dict[Hashable, RowEvents]:
        """One round for every row: draft, verify, accept and roll back per row (round.Rounds.verify_round),
        each row at its own depth (pinned, else `depth`); then the next round's first work is queued
        at `then` (default: `depth` again).

        Returns each row's Round and tokens; rows that reached EOS or max_tokens have left.
        A round where no row drafts is a plain round: each row's next token, no Round event."""
        if not self.ids:
            return {}
        self._delivered()
        if self.clearing is not None:
            self.clearing.add()
        then = depth if then is None else then
        depths = self.depths(depth)
        k = max(depths)
        if k == 0:
            return self._plain_round(then)
        if self.queued is None or self.queued.budgets != depths:
            self._take_back()
            self._catch_up_head()
            self.queued = self._queue_drafts(depth)
        drafts, head_start = self.queued.drafts, self.queued.head_start
        self.queued = None
        depths = drafts.lengths
        out = self.verify_round(drafts.tokens, drafts.probs, head_start, depths)
        self.passes = [RowPass(out.tapes, out.hidden, a + 1, b, p.hidden[p.at : p.at + 1, p.kept - 1 : p.kept])
                       for b, (a, p) in enumerate(zip(out.accepted, self.passes))]
        events = self._emit(depths, [a + 1 for a in out.accepted], out.drafts, out.nxt, out.processed, out.confident,
                            out.details, drafts.sources)
        self._queue_next(then)  # computes while the host hands these tokens out
        return events

    def _emit(self, depths: List[int], kept: List[int], drafts: List[List[int]], nxt: List[int], processed,
              confident: Optional[List] = None, details: Optional[List] = None,
              sources: Optional[List[str]] = None) -> Dict[Hashable, RowEvents]:
        """Each row's Round (when it drafted) and tokens, cut at its EOS or max_tokens; finished rows leave.
        `sources`: where row b's drafts came from (None: the head)."""
        out, staying = {}, []
        for b, (row_id, row) in enumerate(zip(self.ids, self.rows)):
            k = depths[b]
            accepted = drafts[b][: kept[b] - 1]
            tokens = accepted + [nxt[b]]
            scores = row.scored(processed[b], tokens)
            last = Provenance.PLAIN if k == 0 else Provenance.BONUS if len(accepted) == k else Provenance.CORRECTION
            source = sources[b] if sources else "head"
            provenance = [Provenance.COPY if source == "copy" else Provenance.DRAFT] * len(accepted) + [last]
            flags = tuple(confident[b]) if confident else ()
            why = details[b] if details else None
            context = len(row.prompt) + len(row.generated)
            events = ([Round(k, len(accepted), tuple(drafts[b][:k]), why, flags, source, context)] if k
                      else [Parked(context)] if row.depth != 0 else [])  # (pinned at 0: never drafts)
            finish = None
            sent = 0
            for t, p, s in zip(tokens, provenance, scores):
                row.generated.append(t)
                events.append(Token(t, p, s))
                sent += 1
                finish = row.finish(len(row.generated))
                if finish is not None:
                    break
            row.generated += tokens[sent:]  # committed past the cut: the row leaves anyway
            out[row_id] = RowEvents(events, finish)
            if finish is None:
                staying.append(b)
        for row_id, left in self._keep(staying).items():  # settled by the caller to what it delivers
            out[row_id] = out[row_id]._replace(left=left)
        return out
