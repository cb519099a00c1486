"""Batched drafting on the engine thread: concurrent requests decoded together by
speculative.batched.BatchSpeculator, every row drafting with the MTP head.

Rows join between rounds while the batch has room (the decode concurrency) and the memory budget
allows (admission.py); those taken together are prefilled together, each from the prompt cache's
longest prefix, and the state after each prompt is kept there for later requests. Rows leave at EOS, max_tokens, a stop string, a
cancel, or an error of their own (its processors or its output raising): that row fails, the others go
on. A row that finishes (not one that fails) also keeps its final state, settled as the serial
engine's to the tokens its client received but the last, so that a chat's next turn reuses the answer.
Each round's depth is the worker's DepthPolicy's for the rows in it (pinned by --draft-depth N, else
chosen by measured cost, 0 included), except for a row whose request sets its own (pinned_depth),
which keeps that; the policy learns acceptance and round times from the rounds it sees. The rounds also feed the head's health (speculative/heads/health.py); a head found
collapsed under --speculative auto gets plain rounds only from then on.
"""

import logging
import queue
import time
from typing import Dict, Optional

import mlx.core as mx

from speculative.batched import BatchSpeculator, Joiner, Leaving, RowEvents
from speculative.batched.decoding import prompt_entry
from speculative.batched.prefill import prefill_groups, sharing_waves
from speculative.events import Round, Token
from speculative.heads.health import gives_up, watch
from speculative.round.copies import CopiesAndHead
from speculative.round.depth_policy import RoundTimer
from speculative.stats import GenerationStats

from .admission import Admission, RowMemory
from .boundaries import message_starts
from .errors import STOPPED, failure
from .outputs import Traced

log = logging.getLogger("dyno.serve")


def pinned_depth(job) -> Optional[int]:
    """The draft depth a request sets for itself (the playground's "mtp" and its depth; 0 for "off"),
    which its row keeps whatever the policy picks for the others; None: the policy's (no spec of its
    own, or "auto", which leaves the depth to the server and stops drafting with a collapsed head)."""
    if job.spec is None or job.spec.mode == "auto":
        return None
    return 0 if job.spec.mode == "off" else job.spec.draft_depth


class GuardedProcessors:
    """A row's logits processors: if one raises, its job records the error and the logits pass
    unchanged, so the round goes on for the other rows; the row fails after the round."""

    def __init__(self, inner, job):
        self.inner, self.job = inner, job

    def __bool__(self) -> bool:
        return bool(self.inner)

    def tail(self, prompt, generated):
        return self.inner.tail(prompt, generated)

    def row(self, logits, history, drafts=None):
        return self._guarded(self.inner.row, logits, history, drafts)

    def rows(self, logits, history, drafts=None):
        return self._guarded(self.inner.rows, logits, history, drafts)

    def _guarded(self, fn, logits, *args):
        if self.job.error is None:
            try:
                return fn(logits, *args)
            except Exception as e:
                self.job.error = e
        return logits


class DraftingBatch:
    """The batched drafting loop of an EngineWorker (decode concurrency > 1, a head loaded)."""

    def __init__(self, worker):
        self.worker = worker
        lm = worker.lm
        self.batch = self._new_batch()
        self.active: Dict[int, object] = worker.running  # jobs in the batch, by row id
        self.bytes: Dict[int, int] = {}  # each row's estimated memory
        self.admission = Admission(RowMemory.of(lm.config, len(lm.head.layers)), worker.batch_memory())
        self.held = None  # the next job, waiting for memory to free
        self.timer = RoundTimer(worker.policy.record)  # the policy's round times, start to start
        self.next_row = 0

    def _new_batch(self) -> BatchSpeculator:
        cache = self.worker.prefix_cache  # rows that leave hand their states over only to keep them there
        return BatchSpeculator(self.worker.lm, draft_vocab=self.worker.spec.draft_vocab, memory=self.worker.memory,
                               keep_states=cache is not None and cache.enabled,
                               drafter=CopiesAndHead(self.worker.spec.copies))  # a request may ask for its own

    def serve(self) -> None:
        w = self.worker
        while self._admit() and not w.closing.is_set():
            for row, job in list(self.active.items()):
                if job.cancelled.is_set():
                    self._end(row, "cancelled")
            if not self.active:
                if w.swap is not None:  # a model swap waits, and no row is in flight
                    break
                continue
            width = len(self.batch)
            if gives_up(w.lm, w.spec.mode):  # a collapsed head under auto: plain rounds from now on
                depth = then = 0
            else:
                depth, then = w.policy.depth_for(width), w.policy.peek(width)
            # A row pinned deeper than the policy's depth makes the round that deep: timed as such.
            ran = self.batch.deepest(depth)
            try:
                self.timer.start(width, ran, self.batch.deepest(then))
                start = time.perf_counter()
                rounds = self.batch.step(depth, then)
                seconds = time.perf_counter() - start
            except Exception as e:  # not attributable to one request: fail the batch, keep serving
                self.timer.skip()
                log.exception("batched drafting failed")
                for job in self.active.values():
                    w.fail(job, failure(e))
                self.active.clear()
                self.bytes.clear()
                self.batch = self._new_batch()
                w.metrics.set_width(0)
                continue
            w.metrics.record_round(width, ran, seconds)
            w.policy.observe(e for out in rounds.values() for e in out.events)
            for out in rounds.values():
                for event in out.events:
                    if isinstance(event, Round):
                        watch(w.lm, event, w.spec.mode)
            for row, out in rounds.items():
                self.active[row].stats.add_width(width)
                self._deliver(row, out)
            for row, job in list(self.active.items()):  # its own processors raised in the round
                if job.error is not None:
                    self.fail(row, job.error)
        for job in self.active.values():  # closing: the jobs in flight are told so
            w.fail(job, STOPPED, 503)
        self.active.clear()
        if self.held is not None:
            w.fail(self.held, STOPPED, 503)

    # ---- rows joining ----

    def _admit(self) -> bool:
        """Move queued jobs into the batch while there is room (waiting for one when idle), those
        taken together prefilled together; False once closed."""
        w = self.worker
        joining = []  # (job, its row's estimated bytes), prefilled together below
        while len(self.active) + len(joining) < w.concurrency and w.swap is None:  # a swap waiting: no row joins
            job = self.held
            if job is None:
                idle = not self.active and not joining
                if idle:  # an idle wait is no round's time
                    self.timer.skip()
                try:
                    job = w.jobs.get(block=idle)
                except queue.Empty:
                    break
                if job is None:
                    for waiting, _ in joining:
                        w.fail(waiting, STOPPED, 503)
                    return False
                if w.settled_in_queue(job) or w.stale(job):
                    continue
                if job.images is not None:  # not yet a row of the batch: served by itself, the batch waiting
                    self._join(joining)
                    joining = []
                    w.run_alone(job)
                    continue
            tokens = len(job.prompt) + job.params.max_tokens
            deepest = max(w.policy.deepest, pinned_depth(job) or 0)
            if not self.admission.fits(list(self.bytes.values()) + [n for _, n in joining], tokens, deepest):
                self.held = job  # first come, first served: later jobs wait behind it
                break
            self.held = None
            joining.append((job, self.admission.memory.row(tokens, deepest)))
        self._join(joining)
        return True

    def _join(self, joining) -> None:
        """Prefill the jobs' prompts, each after its cached prefix, and add their rows, sending each its
        first token: in waves (a prompt sharing a long prefix with another's waits for that one's
        prompt state, kept in the prompt cache), each wave in groups of similar lengths prefilled
        together, the shorter first (speculative/batched/prefill.py). A job that cannot join fails alone."""
        if not joining:
            return
        self.timer.skip()  # the prefill is no round's time
        cache = self.worker.prefix_cache
        waves = (sharing_waves([job.prompt for job, _ in joining]) if cache is not None and cache.enabled
                 else [list(range(len(joining)))])
        for wave in waves:
            joiners, jobs = self._joiners([joining[i] for i in wave])
            for group in prefill_groups(joiners):  # each group's first tokens go out before the next prefills
                self._add(group, jobs)

    def _joiners(self, joining):
        """The jobs as Joiners, each resuming from the prompt cache's longest prefix: (joiners, row id ->
        (job, its bytes)); a job whose prefix cannot be taken fails here."""
        w = self.worker
        joiners, jobs = [], {}
        for job, nbytes in joining:
            job.stats = GenerationStats(draft_depth=w.spec.draft_depth)
            job.started_at = time.perf_counter()
            row = self.next_row
            self.next_row += 1
            try:
                resume = w.prefix_cache.take(job.prompt, head_layers=len(w.lm.head.layers))
                at = len(resume) if resume else 0
                cuts = w.prefix_cache.plan(len(job.prompt), message_starts(job.prompt, w.marker), at)
            except Exception as e:  # this request alone is refused; the batch goes on
                log.exception("cannot add a request to the batch")
                w.fail(job, failure(e))
                continue
            job.reused = at
            joiners.append(Joiner(row, job.prompt, job.params, resume, cuts, depth=pinned_depth(job),
                                  details=job.spec is not None and job.spec.details, copies=job.copies))
            jobs[row] = job, nbytes
        return joiners, jobs

    def _add(self, joiners, jobs) -> None:
        """Prefill the joiners together and add their rows; keep each prompt's state, then send each
        its first token."""
        w = self.worker
        try:
            outs = self.batch.join_all(joiners)  # (a shared prefill that fails is retried row by row there)
        except Exception as e:  # refused before any prefill: these requests fail, the batch goes on
            log.exception("cannot add requests to the batch")
            for j in joiners:
                w.fail(jobs[j.row_id][0], failure(e))
            return
        for j in joiners:
            job, nbytes = jobs[j.row_id]
            if outs[j.row_id].error is not None:  # its processors raised at its first token, or its prefill failed
                w.fail(job, failure(outs[j.row_id].error))
                continue
            self.active[j.row_id], self.bytes[j.row_id] = job, nbytes
            if j.row_id in self.batch:
                b = self.batch.ids.index(j.row_id)
                row = self.batch.rows[b]
                if row.processors:
                    row.processors = GuardedProcessors(row.processors, job)
                self._keep_prompt(job, b, row)
        w.metrics.set_width(len(self.batch))
        for j in joiners:  # (after every joiner's prompt state is kept: a row ending here leaves the batch)
            if j.row_id in self.active:
                self._deliver(j.row_id, outs[j.row_id])

    def _keep_prompt(self, job, b: int, row) -> None:
        """Keep the state after the prompt (row b of the batch, just joined) in the prompt cache, for
        later requests."""
        cache = self.worker.prefix_cache
        if cache is None or not cache.enabled:
            return
        try:
            cache.put(prompt_entry(self.batch, b, job.prompt))
        except Exception:  # the answer matters more than keeping its state
            log.exception("cannot keep a batched request's prompt state")

    # ---- rows emitting and leaving ----

    def _deliver(self, row: int, out: RowEvents) -> None:
        """A row's events to its job: stats, trace, tokens and text; ends the row when it finished,
        its stop string matched or it was cancelled."""
        w, job = self.worker, self.active[row]
        reason: Optional[str] = None
        try:
            tokens = sum(isinstance(e, Token) for e in out.events)
            for event in out.events:
                if job.trace:
                    job.send(Traced(event, time.perf_counter()))
                job.stats.add(event)
                if isinstance(event, Token):
                    w.on_token(job, event.id, event.logprobs)
                    tokens -= 1
                    if tokens == 0 and out.finish is not None:  # EOS or max_tokens first, as generate checks
                        break
                    if (reason := w.until(job)) is not None:
                        break
        except Exception as e:  # e.g. its detokenizer or tool parser: this request fails alone
            log.exception("a batched request failed")
            self.fail(row, e)
            return
        reason = reason or out.finish
        if reason is not None:
            self._end(row, reason, out.left)

    def _leave(self, row: int) -> Optional[Leaving]:
        left = self.batch.leave(row) if row in self.batch else None
        self.active.pop(row, None)
        self.bytes.pop(row, None)
        self.worker.metrics.set_width(len(self.batch))
        return left

    def _end(self, row: int, reason: str, left=None) -> None:
        """Finish a row (`left`: its state, when it already left the batch in its round or never joined)."""
        w, job = self.worker, self.active[row]
        self._keep_final(job, self._leave(row) or left)
        if reason == "cancelled" and not job.cancelled.is_set():  # cut by shutdown, not by its client
            w.fail(job, STOPPED, 503)
            return
        try:
            w.finish_batched(job, reason)
        except Exception as e:
            log.exception("a batched request failed")
            w.fail(job, failure(e))

    def _keep_final(self, job, left) -> None:
        """Keep the row's state after the tokens its client received but the last (the pending one,
        as the serial engine's `settle`), so that the next turn resumes after this answer."""
        cache = self.worker.prefix_cache
        if left is None or cache is None or not cache.enabled:
            return
        try:
            cache.put(left.settle(len(job.stats.tokens)))  # (each token delivered was counted first)
        except Exception:  # the answer matters more than keeping its state
            log.exception("cannot keep a batched request's final state")

    def fail(self, row: int, error: BaseException) -> None:
        job = self.active[row]
        self._leave(row)
        self.worker.fail(job, failure(error))
