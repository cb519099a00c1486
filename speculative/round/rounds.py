"""The speculative round for B >= 1 rows: draft, verify, accept, roll back.

Every row drafts in one head pass per draft position, and all rows are verified in one trunk pass
of B x (k + 1) tokens; each row accepts by its own rule (row.py) and keeps its own prefix. Rows draft
at their own depths (ragged): the round drafts as deep as its deepest row, and a shallower row
accepts only its first k_b drafts (the rest are verified and rolled back, never emitted), as vLLM's
rejection sampler takes ragged drafts. The caches are the driver's (batched.BatchSpeculator):
batch caches whose row b is request b; rollback goes through mlx-lm's cache protocol.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from ..draft_vocab.head import draft_lm_head, greedy_token
from ..events import RoundDetails
from ..rollback import rollback
from .sampling import log_softmax
from .row import Row
from .verify import confident_rows, greedy_accept


class Verified(NamedTuple):
    """A round's outcome, row b of each list for row b, as Python values; and what `settle` keeps."""

    drafts: List[List[int]]  # the drafts row b verified: its first depths[b]
    accepted: List[int]  # how many of them row b kept
    nxt: List[int]  # row b's next token: the correction, or the bonus when it kept all
    processed: list  # row b's processed verify logits (one [B, k + 1, V] array when all plain greedy)
    hidden: mx.array  # [B, k + 1, H] the trunk hiddens of the tokens verified
    tapes: list  # the verify pass's GDN tapes
    confident: List[Tuple[bool, ...]]  # Round.confident per row (empty while health is not checked)
    details: List[Optional[RoundDetails]]  # per row, when its Row asks (Row.details)


def trim_to(caches: List, rows: int) -> None:
    """Cut each cache (mlx-lm's trim protocol) back to its first `rows` rows."""
    for c in caches:
        c.trim(c.size() - rows)


class Rounds:
    """What every speculative generation shares, for its B rows: the drafts, the verify round and its
    rollback. A subclass sets `target`, `head`, `draft_lm_head`, `rows`, the caches, `pending` ([B]
    tokens emitted but not yet fed to the trunk) and `head_hidden` ([B, 1, H] head output of each
    row's last committed position: its drafts start there)."""

    rows: List[Row]

    def __init__(self, lm, draft_vocab: Optional[int], memory):
        """`lm`: the LoadedModel; `draft_vocab`: the tokens drafts score (None: all); `memory`: how
        MLX's buffer cache is cleared (backend/memory.py)."""
        self.target, self.head = lm.target, lm.head
        self.draft_lm_head = draft_lm_head(lm, draft_vocab)  # the drafts' projection: all rows or a subset
        self.memory = memory

    rope = None  # an image prompt's M-RoPE positions (target.MRoPE); None: mlx-lm's RoPE
    health = None  # the head's health (heads/health.py), while it is checked

    def _head(self, tokens: mx.array, hidden: mx.array, embeddings: Optional[mx.array] = None,
              cache: Optional[List] = None) -> mx.array:
        """Head rows for [B, T] tokens with their [B, T, H] trunk hiddens, into `cache` (default: the
        head's caches); returns post-norm [B, T, H].

        `embeddings` replace the tokens' (an image's rows are the tower's, as vLLM feeds its head).
        """
        embeddings = self.target.embed(tokens) if embeddings is None else embeddings
        return self.head(embeddings, hidden, self.head_cache if cache is None else cache, rope=self.rope)

    def _remember(self, tokens: mx.array, hidden: mx.array, embeddings: Optional[mx.array] = None,
                  cache: Optional[List] = None) -> None:
        """Head rows as `_head` makes them, for rows whose outputs nothing reads (MTPHead.remember)."""
        embeddings = self.target.embed(tokens) if embeddings is None else embeddings
        self.head.remember(embeddings, hidden, self.head_cache if cache is None else cache, rope=self.rope)

    def _trim_head(self, rows: int) -> None:
        """Cut the head's caches back to their first `rows` rows."""
        trim_to(self.head_cache, rows)

    def draft_rows(self, k: int, projection=None) -> Tuple[mx.array, List[Optional[mx.array]]]:
        """k drafts per row by one head pass per step: ([B, k] tokens, per row [k, V] draft probs or None);
        `projection`: the draft step's rows (a DraftLMHead) instead of the round's own."""
        lm_head = self.draft_lm_head if projection is None else projection
        g = self.head_hidden  # [B, 1, H]
        histories = [r.history() if r.processors else None for r in self.rows]
        shared = [r.plain_greedy for r in self.rows]  # their picks are one argmax
        steps, probs = [], [[] for _ in self.rows]
        for j in range(k):
            greedy = greedy_token(lm_head, g[:, -1]) if any(shared) else None  # [B]
            if all(shared):  # (no per-row slices: a round of greedy rows, the serial engine's usual one)
                d = greedy
            else:
                d = self._picks(greedy, lm_head(g[:, -1]), histories, steps, probs, j)
            steps.append(d)
            if j + 1 < k:  # recurse: each row's draft with the head's own output, position + 1
                g = self._head(d[:, None], g)
        drafts = mx.stack(steps, axis=1)
        return drafts, [None if r.params.greedy else mx.concatenate(p) for r, p in zip(self.rows, probs)]

    def _picks(self, greedy: Optional[mx.array], logits: mx.array, histories: list, steps: List[mx.array],
               probs: List[list], j: int) -> mx.array:
        """Draft j of every row from the [B, V] draft logits by the row's own rule (`greedy`'s pick for
        plain greedy rows), appending each sampled row's q to probs[b]."""
        picks = []
        for b, row in enumerate(self.rows):
            if row.plain_greedy:
                picks.append(greedy[b : b + 1])
                continue
            lb = logits[b : b + 1]
            if histories[b] is not None:  # draft j follows the committed tokens and drafts 0..j-1
                lb = row.processors.row(lb, histories[b], mx.concatenate([s[b : b + 1] for s in steps]) if steps else None)
            d, q = row.pick(lb, j)  # draft j proposes the token j past the pending one
            picks.append(d)
            probs[b].append(q)
        return mx.concatenate(picks) if len(picks) > 1 else picks[0]

    def _sync(self, nxt: mx.array, n_acc: mx.array, drafts: mx.array) -> Tuple[List[int], List[int], List[List[int]]]:
        """The round's one host sync: ([B] next tokens, [B] accepted counts, [B, k] drafts) as Python."""
        mx.eval(nxt, n_acc, drafts)
        return nxt.tolist(), n_acc.tolist(), drafts.tolist()

    def verify_round(self, drafts: mx.array, draft_probs: List, head_start: int, depths: Sequence[int]) -> Verified:
        """Verify the rows' [B, k] drafts (drafted from head cache size `head_start`) in one trunk pass,
        row b its first depths[b]; keep each row's accepted prefix, roll the rest back."""
        k, B = drafts.shape[1], len(self.rows)
        logits, hidden, tapes = self.target.verify(
            mx.concatenate([self.pending[:, None], drafts], axis=1), self.trunk_cache, self.rope)
        mx.async_eval(logits, hidden)  # the trunk computes while Python builds the rest of the round
        n_acc, nxt, processed, targets = self._accept(logits, drafts, draft_probs, depths)
        # Gathers from the rows above, started now and read after the round's sync; no token depends on them.
        checks = [self._checks(r, drafts[b, : d], draft_probs[b], targets[b], n_acc[b], nxt[b]) if r.details else None
                  for b, (r, d) in enumerate(zip(self.rows, depths))]
        if asked := [x for c in checks if c is not None for x in c]:
            mx.async_eval(*asked)
        confident = None
        if self.health is not None and self.health.checking:
            confident = [confident_rows(targets[b], d, logprobs=r.params.greedy)
                         for b, (r, d) in enumerate(zip(self.rows, depths))]
            mx.async_eval(*confident)
        # The head's rows for every position the round may keep, queued before the sync: row i
        # pairs trunk hidden i with the token after it, drafts[i] below n_acc and nxt at n_acc.
        # Causal attention keeps the rows past n_acc out of those before; rollback cuts them.
        self._trim_head(head_start)  # the draft recursion's rows
        nxt = nxt.astype(drafts.dtype)
        follow = mx.where(mx.arange(k + 1)[None] < n_acc[:, None],
                          mx.concatenate([drafts, nxt[:, None]], axis=1), nxt[:, None])
        head_rows = self._head(follow, hidden)
        mx.async_eval(head_rows)
        # The one host sync of the round (across ranks its one collective), taken while the head rows compute.
        nxt_ids, accepted, drafted = self._sync(nxt, n_acc, drafts)
        kept = [a + 1 for a in accepted]
        rollback(self.trunk_cache, tapes, k + 1, kept)
        rollback(self.head_cache, [], k + 1, kept)
        # Each row's last kept row drafts next (one row: a slice, as cheap as the serial round was).
        self.head_hidden = (head_rows[:, accepted[0] : accepted[0] + 1] if B == 1 else
                            mx.take_along_axis(head_rows, mx.array(accepted)[:, None, None], axis=1))
        self.pending = mx.array(nxt_ids, dtype=drafts.dtype)
        return Verified(
            [d[: depths[b]] for b, d in enumerate(drafted)], accepted, nxt_ids, processed, hidden, tapes,
            [tuple(c.tolist()) for c in confident] if confident is not None else [()] * B,
            [self._round_details(r, c) if c is not None else None for r, c in zip(self.rows, checks)])

    def _accept(self, logits: mx.array, drafts: mx.array, draft_probs: List,
                depths: Sequence[int]) -> Tuple[mx.array, mx.array, list, list]:
        """Each row's accepted count and next token by its own rule and key over its first depths[b]
        drafts: ([B], [B], the processed logits per row, the target rows per row). Rows all greedy
        without processors share one pass."""
        k = drafts.shape[1]
        if all(r.plain_greedy for r in self.rows):  # every row at once
            target = log_softmax(logits)
            n_acc, nxt = greedy_accept(drafts, target)
            if min(depths) < k:  # a shallower row keeps none of the drafts past its own depth
                n_acc = mx.minimum(n_acc, mx.array(depths))
                nxt = mx.take_along_axis(mx.argmax(target, axis=-1), n_acc[:, None], axis=-1)[:, 0]
            return n_acc, nxt, logits, target
        n_acc, nxt, processed, targets = [], [], [], []
        for b, (row, d) in enumerate(zip(self.rows, depths)):
            probs = draft_probs[b][:d] if draft_probs[b] is not None else None
            n, t, rows, target = row.accept(logits[b, : d + 1], drafts[b, :d], probs)
            n_acc.append(n)
            nxt.append(t.reshape(()).astype(drafts.dtype))
            processed.append(rows)
            targets.append(target)
        return mx.stack(n_acc), mx.stack(nxt), processed, targets

    @staticmethod
    def _checks(row: Row, drafts: mx.array, draft_probs: Optional[mx.array], target: mx.array,
                n_acc: mx.array, nxt: mx.array) -> Tuple[mx.array, ...]:
        """(p, q, accept, next_p) of a row's drafts as lazy arrays: `target` is the greedy rule's
        log-softmax rows or the lossless rule's p rows, `draft_probs` its q rows (None when greedy)."""
        k = drafts.shape[0]
        idx = drafts[:, None]
        if row.params.greedy:
            rows = target.astype(mx.float32)
            p = mx.exp(mx.take_along_axis(rows[:k], idx, axis=-1)[:, 0])
            accept = (mx.argmax(target[:k], axis=-1) == drafts).astype(mx.float32)
            q = mx.zeros_like(p)  # no draft distribution: reported as None
            next_p = mx.exp(rows[n_acc, nxt.reshape(())])
        else:
            p = mx.take_along_axis(target[:k], idx, axis=-1)[:, 0]
            q = mx.take_along_axis(draft_probs, idx, axis=-1)[:, 0]
            accept = mx.minimum(1.0, p / mx.maximum(q, 1e-30))
            next_p = target[n_acc, nxt.reshape(())]
        return p, q, accept, next_p

    @staticmethod
    def _round_details(row: Row, checks: Tuple[mx.array, ...]) -> RoundDetails:
        p, q, accept, next_p = (x.tolist() for x in checks)
        q = [None] * len(p) if row.params.greedy else q
        return RoundDetails(tuple(p), tuple(q), tuple(accept), next_p)
