"""Batched drafting on the engine thread: concurrent requests decoded together as rows of one
speculative.batched.Decoding, the engine's one driver, which owns each row from join to Done (prompt
cache, prefill, each round's depth, settling, the head's health).

This loop keeps admission and delivery. Rows join between rounds while the batch has room (the
decode concurrency) and the memory budget allows (admission.py); those taken together join together.
Rows leave at EOS, max_tokens, a stop string, a cancel, or an error of their own (its processors or
its output raising): that row fails, the others go on. A row's depth is the worker's DepthPolicy's,
except for a request that sets its own (pinned_depth), which its row keeps.
"""

import logging
import queue
import time
from typing import Dict, Optional

from speculative.batched.decoding import Decoding, Request
from speculative.batched.speculator import RowEvents
from speculative.events import Token
from speculative.loader.vision import vision_input
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
        self.decoding = self._new_decoding()
        self.active: Dict[int, object] = worker.running  # jobs in the batch, by row id
        self.bytes: Dict[int, int] = {}  # each row's estimated memory
        lm = worker.lm
        self.admission = Admission(RowMemory.of(lm.config, len(lm.head.layers)), worker.batch_memory())
        self.held = None  # the next job, waiting for memory to free
        self.next_row = 0

    def _new_decoding(self) -> Decoding:
        w = self.worker
        return Decoding(w.lm, w.spec, w.prefix_cache, policy=w.policy, memory=w.memory)

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
            try:
                rounds = self.decoding.step()
            except Exception as e:  # not attributable to one request: fail the batch, keep serving
                log.exception("batched drafting failed")
                for job in self.active.values():
                    w.fail(job, failure(e))
                self.active.clear()
                self.bytes.clear()
                self.decoding = self._new_decoding()
                w.metrics.set_width(0)
                continue
            width = self.decoding.last_round[0]
            w.metrics.record_round(*self.decoding.last_round)
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
        taken together joining together; False once closed."""
        w = self.worker
        joining = []  # (job, its row's estimated bytes), joining together below
        while len(self.active) + len(joining) < w.concurrency and w.swap is None:  # a swap waiting: no row joins
            job = self.held
            if job is None:
                idle = not self.active and not joining
                if idle:  # an idle wait is no round's time
                    self.decoding.idle()
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
        """The jobs join the batch (Decoding.join: each from the prompt cache's longest prefix, in waves
        and prefill groups); each group's first tokens go out before the next group prefills. A job that
        cannot join fails alone."""
        if not joining:
            return
        w, jobs, requests = self.worker, {}, []
        for job, nbytes in joining:
            job.stats = GenerationStats(draft_depth=w.spec.draft_depth)
            try:  # the tower runs here, on the thread that owns MLX
                vision = vision_input(w.lm.target, w.lm.vision, job.prompt, job.images) if job.images is not None else None
            except Exception as e:  # this request alone fails
                log.exception("cannot read a request's images")
                w.fail(job, failure(e))
                continue
            row, self.next_row = self.next_row, self.next_row + 1
            jobs[row] = job, nbytes
            requests.append(Request(row, job.prompt, job.params, message_starts(job.prompt, w.marker),
                                    depth=pinned_depth(job), details=job.spec is not None and job.spec.details,
                                    vision=vision, copies=job.copies))
        for outs in self.decoding.join(requests):
            self._joined(outs, jobs)

    def _joined(self, outs: Dict[int, RowEvents], jobs) -> None:
        """Rows that just joined (or failed to): guard their processors, then send each its first token."""
        w = self.worker
        for row, out in outs.items():
            job, nbytes = jobs[row]
            if out.error is not None:  # its prefix, its prefill or its processors at its first token failed
                w.fail(job, failure(out.error))
                continue
            self.active[row], self.bytes[row] = job, nbytes
            if row in self.decoding.batch:
                state = self.decoding.row(row)
                if state.processors:
                    state.processors = GuardedProcessors(state.processors, job)
        w.metrics.set_width(len(self.decoding))
        for row, out in outs.items():  # (after every row's prompt state is kept: a row ending here leaves)
            if row in self.active:
                self._deliver(row, out)

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
            self._end(row, reason)

    def _leave(self, row: int):
        job = self.active.pop(row)
        self.bytes.pop(row, None)
        self.worker.metrics.set_width(len(self.decoding))
        return job

    def _end(self, row: int, reason: str) -> None:
        """Finish a row: the engine keeps its state settled to the tokens its client received (so the
        next turn resumes after this answer) and gives its Done."""
        w = self.worker
        job = self.active[row]
        done = self.decoding.finish(row, len(job.stats.tokens), reason)  # (each token delivered was counted first)
        self._leave(row)
        if reason == "cancelled" and not job.cancelled.is_set():  # cut by shutdown, not by its client
            w.fail(job, STOPPED, 503)
            return
        try:
            job.stats.add(done)
            w.finish(job, reason)
        except Exception as e:
            log.exception("a batched request failed")
            w.fail(job, failure(e))

    def fail(self, row: int, error: BaseException) -> None:
        self.decoding.drop(row)
        self.worker.fail(self._leave(row), failure(error))
