"""A row's whole life, join to leave, for every caller of the one driver (speculator.BatchSpeculator):
engine.generate (one row), the server's drafting loop (many), and through them the playground and a
model split across processes.

A request joins with its prompt and the positions where its messages start. Its row resumes from
the prompt cache's longest prefix, is checkpointed at those positions as it is prefilled (with the
others joining at once), and the state after its prompt is kept for later requests. Each round's
depth is the policy's (round/depth_policy.py), 0 once the head is found collapsed under "auto"
(heads/health.py, which every Round feeds). When the row finishes or its consumer stops it, its
state is settled to the tokens the consumer received and kept, and its Done carries its timings.
Callers keep admission (who joins, when) and delivery (what the tokens become for a client).
"""

import logging
import time
from typing import Dict, Hashable, Iterator, List, NamedTuple, Optional, Sequence

from ..config import SamplingParams, SpecConfig
from ..events import Done, Round, Token
from ..heads.health import gives_up, watch
from ..loader import LoadedModel
from ..loader.vision import IMAGE_KEY_BASE, VisionInput
from ..backend.memory import MLX_MEMORY, Memory
from ..prompt_cache.store import PrefixCache, PrefixEntry, Resume, entry_from, own_rows
from ..round.depth_policy import DepthPolicy, RoundTimer
from ..round.copies import CopiesAndHead
from ..round.drafter import Drafter
from ..round.row_depth import RoundTimes, RowDepth, context_band
from .prefill import PREFILL_STEP, Joiner, prefill_groups, sharing_waves
from .speculator import BatchSpeculator, Leaving, RowEvents

log = logging.getLogger(__name__)


def drafts(lm: LoadedModel, spec: SpecConfig) -> bool:
    """True when a generation with `spec` drafts: speculation not off, a head loaded, and under "auto"
    not found collapsed (heads/health.py)."""
    return spec.mode != "off" and lm.head is not None and not gives_up(lm, spec.mode)


def prompt_entry(batch: BatchSpeculator, b: int, prompt: List[int]) -> PrefixEntry:
    """Row b's state after its prompt (it just joined `batch`), as a prompt-cache entry."""
    row, n = batch.rows[b], len(prompt)
    entry = entry_from(prompt, [own_rows(c.extract(b)) for c in batch.trunk_cache], row.checkpoints)
    # The head's rows 0..n-1 (its prefill ended with the first token's row): kept one short, with the
    # trunk's last hidden, so that a later request drafts as this one did. A row resumed without head
    # rows (a shifted head) has fewer; its entry stays headless.
    head = [c.extract(b) for c in batch.head_cache]
    if all(h.offset == n for h in head):
        for h in head:
            h.trim(1)
        entry.head_cache = [own_rows(h) for h in head]
        joined = batch.passes[b]  # its prefill's pass: the trunk's hidden at the prompt's end
        entry.last_hidden = joined.hidden[joined.at : joined.at + 1]
    return entry


class Request(NamedTuple):
    """A row to decode: its prompt and sampling, where its messages start, and its own settings."""

    row_id: Hashable
    prompt: Sequence[int]
    params: SamplingParams
    boundaries: Sequence[int] = ()  # where later prompts may part from this one: checkpointed
    depth: Optional[int] = None  # its own draft depth (0: never drafts); None: the policy's
    details: bool = False  # its Rounds carry each draft's p, q and acceptance chance
    rng_seed: Optional[int] = None  # an unseeded request's draws from it
    vision: Optional[VisionInput] = None  # a prompt's images (the prompt cache keys them by their pixels)
    resume: Optional[Resume] = None  # a prefix its caller already has, instead of the prompt cache's
    cuts: Sequence[int] = ()  # with no prompt cache: where its caller wants the recurrent state checkpointed
    copies: Optional[str] = None  # its drafts' source (round/copies.py: on, off, only); None: the spec's


def cache_key(r: Request) -> Optional[Sequence[int]]:
    """The request's prompt as the prompt cache keys it: its tokens, each image's rows spelling its
    pixels' digest (loader.vision.cache_key); None for an image prompt without one (never cached)."""
    if r.vision is None:
        return r.prompt
    return r.vision.key if len(r.vision.key) == len(r.prompt) else None


def resume_inside_image(key: Sequence[int], at: int) -> bool:
    """True when a prefix of `at` tokens would end inside an image: the head's open row there takes
    the token's embedding, not the image's (entries end at message boundaries, so this is a guard)."""
    return at < len(key) and key[at] >= IMAGE_KEY_BASE


class Life:
    """What a row's end needs: its prompt, what it reused, its times, and its state once it left."""

    def __init__(self, request: Request, reused: int, keep: bool, key: Optional[Sequence[int]]):
        self.prompt, self.reused, self.keep = list(request.prompt), reused, keep
        self.key = list(key) if key is not None else self.prompt  # the prompt as the prompt cache keys it
        self.started = time.perf_counter()
        self.first_at: Optional[float] = None
        self.last_at: Optional[float] = None
        self.left: Optional[Leaving] = None  # set when it left the batch within a join or a round


class Decoding:
    """Rows decoded together, each from its join to its Done."""

    def __init__(self, lm: LoadedModel, spec: SpecConfig, prefix_cache: Optional[PrefixCache] = None,
                 policy: Optional[DepthPolicy] = None, prefill_step: int = PREFILL_STEP, memory: Memory = MLX_MEMORY,
                 drafter: Optional[Drafter] = None, clear_per_rounds: bool = True, keep_states: bool = False,
                 keep_prompts: bool = True):
        """`policy`: each round's depth (default: the spec's, else pinned at its depth); `drafter`: where
        drafts come from (the MTP head unless given); `clear_per_rounds` False: the caller clears MLX's
        buffer cache on its own cadence; `keep_states`: rows hand back their states (settle) even
        without a prompt cache to keep them in; `keep_prompts` False: a row's state after its prompt is
        not kept as it joins (one row alone: its final state, kept as it ends, holds all it would offer)."""
        self.lm, self.spec = lm, spec
        self.cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self.keep_prompts = keep_prompts
        self.policy = policy or spec.policy or DepthPolicy(None, [], pinned=spec.draft_depth)
        drafter = drafter if drafter is not None else CopiesAndHead(spec.copies)  # the head, and copies unless off
        self.batch = BatchSpeculator(lm, prefill_step, spec.draft_vocab, memory, self.cache is not None or keep_states,
                                     drafter, clear_per_rounds)
        self.timer = RoundTimer(self._record)  # the policy's round times, start to start, and the rows'
        self.times = RoundTimes(self.policy.costs)  # by width, depth and context band: what rows weigh
        self.row_depths: Dict[Hashable, RowDepth] = {}  # rows choosing their own depth (policy.per_row)
        self.band: Optional[int] = None  # the context band of the round running now
        self.lives: Dict[Hashable, Life] = {}
        self.last_round: Optional[tuple] = None  # (width, depth it ran at, seconds) of the latest step

    def __len__(self) -> int:
        return len(self.batch)

    def __contains__(self, row_id: Hashable) -> bool:
        return row_id in self.lives

    # ---- joining ----

    def join(self, requests: Sequence[Request]) -> Iterator[Dict[Hashable, RowEvents]]:
        """Each request's first token, group by group as they are prefilled (so that a group's tokens can
        go out before the next prefills); a request that fails alone gets RowEvents.error and no row.

        Prompts sharing a long prefix join in waves (prefill.sharing_waves): a later wave resumes from
        the state an earlier one kept in the prompt cache instead of computing it again."""
        self.timer.skip()  # the prefill is no round's time
        waves = (sharing_waves([cache_key(r) or r.prompt for r in requests]) if self.cache is not None
                 else [list(range(len(requests)))])
        for wave in waves:
            joiners, failed = [], {}
            for i in wave:
                try:
                    joiners.append(self._joiner(requests[i]))
                except Exception as e:  # its prefix could not be taken: this request alone fails
                    log.exception("cannot add a request to the batch")
                    failed[requests[i].row_id] = RowEvents([], error=e)
            if failed:
                yield failed
            for group in prefill_groups(joiners):
                yield self._join_group(group)

    def join_one(self, request: Request) -> RowEvents:
        """One request joins (join): its first token, or its error raised."""
        (out,) = [outs[request.row_id] for outs in self.join([request])]
        if out.error is not None:
            raise out.error
        return out

    def _joiner(self, r: Request) -> Joiner:
        """The request as a Joiner, resuming from the prompt cache's longest prefix, cut at its boundaries."""
        key = cache_key(r)
        keep = self.cache is not None and key is not None
        resume, cuts = r.resume, list(r.cuts)
        if keep:
            if resume is None:
                resume = self.cache.take(key, head_layers=len(self.lm.head.layers))
                if resume is not None and resume_inside_image(key, len(resume)):
                    resume = None
            cuts = self.cache.plan(len(r.prompt), r.boundaries, len(resume) if resume else 0)
        self.lives[r.row_id] = Life(r, len(resume) if resume else 0, keep, key)
        return Joiner(r.row_id, r.prompt, r.params, resume, cuts, r.depth, r.details, r.rng_seed, r.vision, r.copies)

    def _join_group(self, group: List[Joiner]) -> Dict[Hashable, RowEvents]:
        try:
            outs = self.batch.join_all(group)  # (a shared prefill that fails is retried row by row there)
        except Exception as e:  # refused before any prefill: these requests fail, the batch goes on
            outs = {j.row_id: RowEvents([], error=e) for j in group}
        now = time.perf_counter()
        for j in group:
            out, life = outs[j.row_id], self.lives[j.row_id]
            if out.error is not None:
                del self.lives[j.row_id]
                continue
            life.first_at = life.last_at = now
            life.left = out.left
            if self.policy.per_row and j.depth is None:  # (a request's own depth is kept as it asked)
                self.row_depths[j.row_id] = RowDepth(self.policy.acceptance())
            if j.row_id in self.batch and life.keep and self.keep_prompts:
                self._keep_prompt(self.batch.ids.index(j.row_id), life.key)
        return outs

    def _keep_prompt(self, b: int, prompt: List[int]) -> None:
        """Keep the state after the prompt (row b, just joined) in the prompt cache, for later requests."""
        try:
            self.cache.put(prompt_entry(self.batch, b, prompt))
        except Exception:  # the answer matters more than keeping its state
            log.exception("cannot keep a request's prompt state")

    # ---- rounds ----

    def step(self) -> Dict[Hashable, RowEvents]:
        """One round for every row at the policy's depth (0 once the head collapsed under "auto"): each
        row's Round and tokens; rows that reached EOS or max_tokens have left the batch (not yet ended:
        `finish` ends them). Raises what the round raised; the rows are then lost (`drop` them)."""
        width = len(self.batch)
        if gives_up(self.lm, self.spec.mode):  # a collapsed head: plain rounds from now on
            depth = then = 0
        else:
            depth, then = self.policy.depth_for(width), self.policy.peek(width)
        band = context_band(max(len(r.prompt) + len(r.generated) for r in self.batch.rows))
        if self.row_depths:  # each such row as deep as its own acceptance pays, up to the round's depth
            seconds = lambda k: self.times.seconds(width, k, band)  # noqa: E731
            for row in self.batch.rows:
                if row.id in self.row_depths:
                    row.chosen = self.row_depths[row.id].choose(depth, seconds)
        ran = self.batch.deepest(depth)  # a row pinned deeper makes the round that deep: timed as such
        self.timer.start(width, ran, self.batch.deepest(then))
        self.band = band
        start = time.perf_counter()
        try:
            outs = self.batch.step(depth, then)
        except Exception:
            self.timer.skip()
            raise
        now = time.perf_counter()
        self.last_round = (width, ran, now - start)
        self.policy.observe(e for out in outs.values() for e in out.events)
        for row_id, out in outs.items():
            life = self.lives[row_id]
            rounds = [e for e in out.events if isinstance(e, Round)]
            for event in rounds:
                watch(self.lm, event, self.spec.mode)
            if row_id in self.row_depths:
                self.row_depths[row_id].observe(rounds[0] if rounds else None)
            if any(isinstance(e, Token) for e in out.events):
                life.last_at = now
            if out.left is not None:
                life.left = out.left
        return outs

    def _record(self, width: int, depth: int, seconds: float, then: Optional[int] = None) -> None:
        """A timed round (RoundTimer): the policy's clock, and the times by context band the rows weigh."""
        self.policy.record(width, depth, seconds, then)
        if self.band is not None:
            self.times.record(width, depth, self.band, seconds, then)

    def idle(self) -> None:
        """The caller waits for work between rounds: that wait is no round's time."""
        self.timer.skip()

    # ---- leaving ----

    def settle(self, row_id: Hashable, delivered: int) -> Optional[PrefixEntry]:
        """Take the row out, its state settled to its prompt and the first `delivered` tokens but the
        last (batched.settle); None when it kept no state (nothing to keep it in, or it failed to leave)."""
        life = self.lives.pop(row_id)
        self.row_depths.pop(row_id, None)
        left = self.batch.leave(row_id) if row_id in self.batch else life.left
        return left.settle(delivered) if left is not None and delivered > 0 else None

    def finish(self, row_id: Hashable, delivered: int, reason: str) -> Done:
        """End a row whose consumer received `delivered` tokens: its settled state kept in the prompt
        cache (so a chat's next turn resumes after this answer), and its Done."""
        life = self.lives[row_id]
        try:
            entry = self.settle(row_id, delivered) if life.keep else self.drop(row_id)
            if entry is not None:
                self.cache.put(entry)
        except Exception:  # the answer matters more than keeping its state
            log.exception("cannot keep a request's final state")
        first = life.first_at or life.started
        return Done(reason, len(life.prompt), delivered, first - life.started, (life.last_at or first) - first,
                    life.reused)

    def drop(self, row_id: Hashable) -> None:
        """Take the row out without keeping its state (it failed, or the engine raised)."""
        self.lives.pop(row_id, None)
        self.row_depths.pop(row_id, None)
        if row_id in self.batch:
            self.batch.leave(row_id)

    def row(self, row_id: Hashable):
        """The row's own state (round.row.Row) while it is in the batch."""
        return self.batch.rows[self.batch.ids.index(row_id)]
