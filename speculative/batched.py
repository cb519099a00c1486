"""Batched drafting: B rows, each its own request, share one head pass per draft step and one trunk
pass per round; acceptance, rollback, RNG and stopping stay per row.

A row is prefilled alone at its own length (the single-row Speculator's prefill, prefix reuse
included) and then joins: its attention caches become rows of mlx-lm BatchKVCaches (left padding,
a RoPE offset per row), its Gated DeltaNet caches rows of ArraysCaches (no pad token ever enters a
recurrent state). Rows leave between rounds. Rollback is exact per row: a row's rejected KV slots
are rolled into its own left padding, where the mask hides them (a zeroed key would still add e^0
to the softmax denominator), and its GDN state is taken from its own position on the verify tape.

Depth 0 is a plain batched round: the trunk alone over each row's pending token, no Round event
(a round that drafts nothing is not a drafting round), the head's rows deferred until drafting resumes.
Each round queues the next one's first work before it hands its tokens out, so the device computes
while the host works: for a plain round next, its pass (as mlx-lm's BatchGenerator does), for a
drafting round next, its drafts (as the single-row Speculator does), at the depth the caller says
comes next. A join, a leave or a round at another depth first takes that work back (the caches
rewound, the RNG keys restored), so it never changes a token.
"""

from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, dynamic_roll

from .rollback import GDNTape, replay_rows, restore, snapshot
from .config import SamplingParams
from .draft_vocab.head import draft_lm_head, greedy_token
from .engine import PREFILL_STEP, Speculator
from .errors import DynoError
from .events import Provenance, Round, Token
from .loader import LoadedModel
from .backend.memory import MLX_MEMORY, Memory
from .prompt_cache.store import Resume, ShiftedKVCache
from .sampling import log_softmax, warp
from .verify import agreeing_accept, confident_rows, greedy_accept, lossless_accept

# Left padding every row of a cache shares is dropped once it reaches this many slots.
COMPACT_AT = 256
# Depth-0 rounds owe the head this many rows at most before it runs over them in one pass: the
# trunk hiddens they hold stay small, and drafting, when it resumes, starts from a short catch-up.
HEAD_BACKLOG = 32


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


def keep_rows(batch: List, indices: List[int]) -> None:
    """Keep only the rows at `indices` of every cache in `batch`."""
    index = mx.array(indices)
    for c in batch:
        c.filter(index)


def trim_rows(cache: BatchKVCache, fed: int, kept: List[int]) -> None:
    """Of the last `fed` slots keep row i's first kept[i]: the slots it rejected are rolled right
    into its left padding (masked, never zeroed); its offset (RoPE position) drops by as many."""
    drop = [fed - k for k in kept]
    cache.trim(min(drop))  # the part every row drops
    extra = [d - min(drop) for d in drop]
    if not any(extra):  # every row dropped alike: its padding is as it was
        return
    # As BatchKVCache.finalize: roll each row by its own count.
    shift = mx.array(extra)
    cache.keys = dynamic_roll(cache.keys, shift[:, None], axis=2)
    cache.values = dynamic_roll(cache.values, shift[:, None], axis=2)
    cache.offset = cache.offset - shift
    cache.left_padding = cache.left_padding + shift
    shared = mx.min(cache.left_padding).item()
    if shared >= COMPACT_AT:  # padding every row has: drop it, as BatchKVCache.filter does
        cache.keys, cache.values = cache.keys[..., shared:, :], cache.values[..., shared:, :]
        cache._idx -= shared
        cache.left_padding = cache.left_padding - shared


def commit_rows(tape: GDNTape, consumed: List[int]) -> None:
    """GDNTape.commit per row: row i's conv window and state after its first consumed[i] tokens."""
    if len(set(consumed)) == 1:  # (every row kept every token included: then nothing to do)
        tape.commit(consumed[0])
        return
    rows = mx.arange(len(consumed))
    c = mx.array(consumed)
    window = tape.cache[0].shape[1]  # K-1: the pass left its last rows there
    # After consuming c tokens the window is rows [c, c + K-1) of conv_input.
    tape.cache[0] = tape.conv_input[rows[:, None], c[:, None] + mx.arange(window)[None]]
    if tape.states is not None:
        states = mx.stack([tape.state_before] + tape.states, axis=1)  # [B, T+1, Hv, Dv, Dk]
        tape.cache[1] = states[rows, c]
    else:  # the Metal kernel kept only the final state: replay each row's kept steps, in one call
        tape.cache[1] = replay_rows(tape.replay, tape.state_before, tape.cache[1], consumed)


def rollback_rows(attention: List, tapes: List[GDNTape], fed: int, kept: List[int]) -> None:
    """After a pass of `fed` tokens per row, keep row i's first kept[i] in every cache given."""
    for c in attention:
        trim_rows(c, fed, kept)
    for tape in tapes:
        commit_rows(tape, kept)


# ---- the speculator ----

class RowEvents(NamedTuple):
    """What one row emitted in a join or a round, and why it finished (None: it goes on)."""

    events: List[Union[Round, Token]]
    finish: Optional[str] = None  # "stop" (EOS) or "length" (max_tokens)


class PlainPass(NamedTuple):
    """A depth-0 pass, queued: each row's next token, the trunk hiddens the head owes rows for, the
    processed logits, and what rewinds it (the trunk caches before it, the rows' RNG keys)."""

    nxt: mx.array  # [B]
    hidden: mx.array  # [B, 1, H]
    processed: object  # [B, 1, V] logits, or per row [1, V]
    caches: list
    keys: List[mx.array]


class QueuedDrafts(NamedTuple):
    """The next drafting round's drafts, queued: the depth they were drafted at, ([B, k] tokens, per
    row [k, V] draft probs or None), and what takes them back (the head caches' size before the
    draft recursion, the rows' RNG keys)."""

    depth: int
    drafts: Tuple[mx.array, List]
    head_start: int
    keys: List[mx.array]


class BatchSpeculator:
    """Rows of speculative generation drafted and verified together; rows join and leave between rounds.

    Each row is a single-row Speculator that holds the row's own state (prompt, generated tokens,
    sampling parameters, processors, RNG key); the caches, pending tokens and head hiddens of all
    rows live here, row b of each batch array belonging to self.ids[b].
    """

    def __init__(self, lm: LoadedModel, prefill_step: int = PREFILL_STEP, draft_vocab: Optional[int] = None,
                 memory: Memory = MLX_MEMORY):
        if lm.head is None:
            raise DynoError("batched drafting needs an MTP head")
        if lm.ranks is not None:
            raise DynoError("batched drafting runs in one process")
        self.lm, self.target, self.head = lm, lm.target, lm.head
        self.prefill_step, self.draft_vocab = prefill_step, draft_vocab
        self.draft_lm_head = draft_lm_head(lm, draft_vocab)
        self.memory = memory  # rows clear MLX's buffer cache after each prefill chunk (Speculator.prefill)
        self.clearing = memory.per_rounds()  # and the batch every 512 rounds, as BatchGenerator
        self.ids: List[Hashable] = []  # row b's request
        self.rows: List[Speculator] = []  # row b's own state
        self.trunk_cache: List = []  # batch caches, one per trunk layer
        self.head_cache: List = []  # batch caches, one per head layer
        self.pending: Optional[mx.array] = None  # [B] each row's emitted token the trunk has not seen
        self.head_hidden: Optional[mx.array] = None  # [B, 1, H] head output of each row's last committed row
        # Head rows owed by depth-0 rounds, run in one pass when drafting resumes (or a row joins):
        # per round ([B, 1] tokens, [B, 1, H] trunk hiddens), row b's pair = (token after position p, h_p).
        self.backlog: List[Tuple[mx.array, mx.array]] = []
        self.ahead: Optional[PlainPass] = None  # the next plain round's pass, queued by this one
        self.queued: Optional[QueuedDrafts] = None  # the next drafting round's drafts, queued by this one

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, row_id: Hashable) -> bool:
        return row_id in self.ids

    def join(self, row_id: Hashable, prompt: Sequence[int], params: SamplingParams,
             resume: Optional[Resume] = None, cuts: Sequence[int] = ()) -> RowEvents:
        """Prefill `prompt` alone (after `resume`'s prefix), then add the row to the batch; returns its
        first token. A row that ends at its first token never joins."""
        if row_id in self.ids:
            raise DynoError(f"row {row_id!r} is already in the batch")
        if len(prompt) == 0:
            raise DynoError("the prompt is empty")
        row = Speculator(self.lm, params, 1, self.prefill_step, self.draft_vocab, memory=self.memory)
        row.prompt = list(prompt)
        row.generated = [row.prefill(row.prompt, resume, cuts).item()]
        out = RowEvents([Token(row.generated[0], Provenance.PLAIN, row.scores[0])], self._finish(row, 1))
        if out.finish is not None:
            return out
        self._take_back()
        self._catch_up_head()  # the rows already here owe head rows; the joiner owes none
        trunk, head = as_batch(row.trunk_cache), as_batch(row.head_cache)
        row.trunk_cache = row.head_cache = None  # the batch owns them now
        if self.ids:
            extend(self.trunk_cache, trunk)
            extend(self.head_cache, head)
            self.pending = mx.concatenate([self.pending, row.pending])
            self.head_hidden = mx.concatenate([self.head_hidden, row.head_hidden])
        else:
            self.trunk_cache, self.head_cache = trunk, head
            self.pending, self.head_hidden = row.pending, row.head_hidden
        self.ids.append(row_id)
        self.rows.append(row)
        return out

    def leave(self, row_id: Hashable) -> None:
        """Drop a row (a stop string, a cancel, an error) between rounds."""
        self._keep([b for b, i in enumerate(self.ids) if i != row_id])

    def _keep(self, indices: List[int]) -> None:
        if len(indices) == len(self.ids):
            return
        self._take_back()
        self.ids = [self.ids[b] for b in indices]
        self.rows = [self.rows[b] for b in indices]
        if not indices:
            self.trunk_cache, self.head_cache, self.pending, self.head_hidden = [], [], None, None
            self.backlog = []
            return
        keep_rows(self.trunk_cache + self.head_cache, indices)
        index = mx.array(indices)
        self.pending, self.head_hidden = self.pending[index], self.head_hidden[index]
        self.backlog = [(tokens[index], hidden[index]) for tokens, hidden in self.backlog]

    def _catch_up_head(self) -> None:
        """Run the head over the rows the depth-0 rounds deferred: every row owes the same count."""
        if self.backlog:
            tokens = mx.concatenate([t for t, _ in self.backlog], axis=1)
            hidden = mx.concatenate([h for _, h in self.backlog], axis=1)
            self.head_hidden = self.head(self.target.embed(tokens), hidden, self.head_cache)[:, -1:]
            mx.async_eval(self.head_hidden)
            self.backlog = []

    def _all_greedy(self) -> bool:
        """True when every row is greedy without logits processors: its pick is the argmax alone."""
        return all(r.params.greedy and not r.processors for r in self.rows)

    def _plain_pass(self, ahead: int = 0) -> PlainPass:
        """Queue depth 0's pass: the trunk over each row's pending token (mlx-lm's own forward), each
        row's token picked by its own rule and key; `ahead`: tokens of each row not yet emitted before
        it (a seeded row draws with its position's key). Nothing is evaluated."""
        caches, keys = snapshot(self.trunk_cache), [r.key for r in self.rows]
        hidden = self.target.hidden(self.pending[:, None], self.trunk_cache)  # [B, 1, H]
        logits = self.target.lm_head(hidden)
        if self._all_greedy():  # one argmax for every row
            nxt, processed = mx.argmax(log_softmax(logits[:, 0]), axis=-1).astype(self.pending.dtype), logits
        else:
            nxt, processed = [], []
            for b, row in enumerate(self.rows):
                rows = row._process(logits[b])
                nxt.append(row._pick_target(rows, ahead)[0].astype(self.pending.dtype))  # argmax, or a draw with the row's key
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
            for c in self.head_cache:
                c.trim(c.size() - self.queued.head_start)
            keys, self.queued = self.queued.keys, None
        else:
            return
        for row, key in zip(self.rows, keys):
            row.key = key

    def _queue_drafts(self, k: int) -> QueuedDrafts:
        """Draft the next round at depth k and start computing the drafts."""
        start, keys = self.head_cache[0].size(), [r.key for r in self.rows]
        drafts = self.draft(k)
        mx.async_eval(drafts[0])
        return QueuedDrafts(k, drafts, start, keys)

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
        if then > 0:
            self._catch_up_head()
            self.queued = self._queue_drafts(then)
        else:
            self._look_ahead(0)

    def _plain_round(self, then: int) -> Dict[Hashable, RowEvents]:
        """Depth 0: this round's pass (queued by the last round, or now), and with a plain round next,
        its pass queued behind this one before the one host sync; the head's rows are owed, not run."""
        if self.ahead is None:
            self._take_back()
        now, self.ahead = self.ahead or self._plain_pass(), None
        self.pending = now.nxt
        self.backlog.append((now.nxt[:, None], now.hidden))
        if len(self.backlog) >= HEAD_BACKLOG:
            self._catch_up_head()
        if then == 0:
            self._look_ahead(1)
        mx.eval(now.nxt)  # the round's one host sync
        out = self._emit(0, [1] * len(self.rows), [[] for _ in self.rows], now.nxt.tolist(), now.processed)
        if then > 0:  # drafts follow the emitted tokens (a row's processors read them)
            self._queue_next(then)
        return out

    def step(self, depth: int, then: Optional[int] = None) -> Dict[Hashable, RowEvents]:
        """One round for every row at draft depth `depth`: draft, verify, accept and roll back per row;
        then the next round's first work is queued at depth `then` (default: `depth` again).

        Returns each row's Round and tokens; rows that reached EOS or max_tokens have left.
        Depth 0 is a plain round: each row's next token, no Round event."""
        if not self.ids:
            return {}
        self.clearing.add()
        then = depth if then is None else then
        if depth == 0:
            return self._plain_round(then)
        k, B = depth, len(self.ids)
        if self.queued is None or self.queued.depth != k:
            self._take_back()
            self._catch_up_head()
            self.queued = self._queue_drafts(k)
        (drafts, draft_probs), head_start = self.queued.drafts, self.queued.head_start  # [B, k], per row [k, V] or None
        self.queued = None
        logits, hidden, tapes = self.target.verify(
            mx.concatenate([self.pending[:, None], drafts], axis=1), self.trunk_cache)
        mx.async_eval(logits, hidden)
        health = self.lm.head_health
        n_acc, nxt, processed, confident = self._accept(logits, drafts, draft_probs, health is not None and health.checking)
        if confident is not None:  # read with the round's sync (Round.confident)
            mx.async_eval(confident)
        # Head rows for every position a row may keep (as Speculator.step): cut the draft
        # recursion's rows, then row i pairs trunk hidden i with the token after it.
        for c in self.head_cache:
            c.trim(c.size() - head_start)
        follow = mx.where(mx.arange(k + 1)[None] < n_acc[:, None],
                          mx.concatenate([drafts, nxt[:, None]], axis=1), nxt[:, None])
        head_rows = self.head(self.target.embed(follow), hidden, self.head_cache)
        mx.async_eval(head_rows)  # queued with the round's sync, as in the serial round
        mx.eval(n_acc, nxt, drafts)  # the round's one host sync
        kept = [a + 1 for a in n_acc.tolist()]
        rollback_rows([c for c in self.trunk_cache if isinstance(c, BatchKVCache)], tapes, k + 1, kept)
        rollback_rows(self.head_cache, [], k + 1, kept)
        self.head_hidden = head_rows[mx.arange(B), n_acc][:, None]
        self.pending = nxt
        confident = confident.tolist() if confident is not None else [()] * B
        out = self._emit(k, kept, drafts.tolist(), nxt.tolist(), processed, confident)
        self._queue_next(then)  # computes while the host hands these tokens out
        return out

    def _accept(self, logits: mx.array, drafts: mx.array, draft_probs: List,
                check: bool = False) -> Tuple[mx.array, mx.array, List, Optional[mx.array]]:
        """Each row's accepted count and next token by its own rule and key: ([B], [B], the
        processed [k+1, V] logits per row, and when `check` the [B, k] Round.confident flags, else
        None). Greedy rows without processors share one pass."""
        k = drafts.shape[1]
        if self._all_greedy():  # every row at once
            target = log_softmax(logits)
            n_acc, nxt = greedy_accept(drafts, target)
            confident = confident_rows(target, k, logprobs=True) if check else None
            return n_acc, nxt.astype(drafts.dtype), logits, confident
        n_acc, nxt, processed, confident = [], [], [], []
        for b, row in enumerate(self.rows):
            rows = row._process(logits[b], drafts[b])  # the processors the row's drafts saw
            if row.params.greedy:
                target = log_softmax(rows)
                n, t = greedy_accept(drafts[b], target)
            else:
                target = mx.exp(warp(rows, row.params))
                if row.keys is not None:  # seeded: plain mlx-lm's own draws, the drafts kept while they agree
                    n, t = agreeing_accept(drafts[b], row._seeded_tokens(rows))
                else:
                    n, t = lossless_accept(drafts[b], draft_probs[b], target, row._split())
            if check:
                confident.append(confident_rows(target, k, logprobs=row.params.greedy))
            n_acc.append(n)
            nxt.append(t.astype(drafts.dtype))
            processed.append(rows)
        return mx.stack(n_acc), mx.stack(nxt), processed, mx.stack(confident) if check else None

    def draft(self, k: int):
        """k drafts per row by one head pass per step: ([B, k] tokens, per row [k, V] draft probs or None)."""
        g = self.head_hidden  # [B, 1, H]
        histories = [r._history() if r.processors else None for r in self.rows]
        plain = [r.params.greedy and h is None for r, h in zip(self.rows, histories)]
        steps, probs = [], [[] for _ in self.rows]
        for j in range(k):
            greedy = greedy_token(self.draft_lm_head, g[:, -1]) if any(plain) else None  # [B]
            logits = self.draft_lm_head(g[:, -1]) if not all(plain) else None  # [B, V]
            picks = []
            for b, row in enumerate(self.rows):
                if plain[b]:
                    picks.append(greedy[b : b + 1])
                    continue
                lb = logits[b : b + 1]
                if histories[b] is not None:  # draft j follows the committed tokens and drafts 0..j-1
                    lb = row.processors.row(lb, histories[b], mx.concatenate([s[b : b + 1] for s in steps]) if steps else None)
                d, q = row._pick(lb, j)
                picks.append(d)
                probs[b].append(q)
            d = mx.concatenate(picks) if len(picks) > 1 else picks[0]
            steps.append(d)
            if j + 1 < k:  # recurse: each row's draft with the head's own output, position + 1
                g = self.head(self.target.embed(d[:, None]), g, self.head_cache)
        drafts = mx.stack(steps, axis=1)
        return drafts, [None if r.params.greedy else mx.concatenate(p) for r, p in zip(self.rows, probs)]

    def _emit(self, k: int, kept: List[int], drafts: List[List[int]], nxt: List[int], processed,
              confident: Optional[List] = None) -> Dict[Hashable, RowEvents]:
        """Each row's Round and tokens, cut at its EOS or max_tokens; finished rows leave."""
        out, staying = {}, []
        for b, (row_id, row) in enumerate(zip(self.ids, self.rows)):
            accepted = drafts[b][: kept[b] - 1]
            tokens = accepted + [nxt[b]]
            scores = row._scored(processed[b], tokens)
            last = Provenance.PLAIN if k == 0 else Provenance.BONUS if len(accepted) == k else Provenance.CORRECTION
            provenance = [Provenance.DRAFT] * len(accepted) + [last]
            flags = tuple(confident[b]) if confident else ()
            events, finish = ([Round(k, len(accepted), tuple(drafts[b][:k]), confident=flags)] if k else []), None
            sent = 0
            for t, p, s in zip(tokens, provenance, scores):
                row.generated.append(t)
                events.append(Token(t, p, s))
                sent += 1
                finish = self._finish(row, len(row.generated))
                if finish is not None:
                    break
            row.generated += tokens[sent:]  # committed past the cut: the row leaves anyway
            out[row_id] = RowEvents(events, finish)
            if finish is None:
                staying.append(b)
        self._keep(staying)
        return out

    @staticmethod
    def _finish(row: Speculator, n: int) -> Optional[str]:
        """Why a row ends after its n-th token, or None."""
        if row.generated[n - 1] in row.eos:
            return "stop"
        if n >= row.params.max_tokens:
            return "length"
        return None
