"""Plain batched decoding on the engine thread, for a model without an MTP head (or speculation off):
concurrent requests handed to mlx-lm's BatchGenerator, as mlx-lm's own server does.

Rows join between steps while the batch has room (the decode concurrency), each resuming from the
prompt cache's longest prefix and checkpointed where its chat messages start; each keeps its final
state there when it ends. BatchGenerator samples every row from one generator, so a seeded sampled
request would neither get mlx-lm's text for its seed nor leave the others' draws alone: it runs by
itself (as does a prompt with images), the batch waiting. A row whose sampler, processors or output
raises fails alone; a step that fails for no one row fails the batch, and serving goes on.
"""

import logging
import queue
import time
from typing import Callable, Dict, List

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from speculative.engine import scored
from speculative.events import Provenance, Token
from speculative.prompt_cache.store import Checkpoint, entry_from, own_rows, owned, recurrent_state
from speculative.round.processors import processors_for
from speculative.round.sampling import plain_sampler
from speculative.stats import GenerationStats

from .boundaries import message_starts
from .errors import STOPPED, failure
from .jobs import Job

log = logging.getLogger("dyno.serve")


class PlainBatch:
    """The plain batched loop of an EngineWorker (decode concurrency > 1, no drafting)."""

    def __init__(self, worker):
        self.worker = worker
        self.batch = self._new_batch()
        self.active: Dict[int, Job] = worker.running  # jobs in the batch, by batch uid

    def _new_batch(self) -> BatchGenerator:
        w = self.worker
        n = w.concurrency
        return BatchGenerator(w.lm.model, stop_tokens=[[t] for t in w.eos],
                              completion_batch_size=n, prefill_batch_size=n)

    def serve(self) -> None:
        """Decode until the worker closes, or a model swap waits and the rows in flight have ended."""
        w, active = self.worker, self.active
        while True:
            if not self._admit(wait=not active) or w.closing.is_set():
                break
            for uid, job in list(active.items()):
                if job.cancelled.is_set():
                    self._keep(job, self.batch.remove([uid], return_prompt_caches=True).get(uid))
                    w.finish_batched(active.pop(uid), "cancelled")
            if not active:
                if w.swap is not None:
                    break
                continue
            try:
                width = len(active)
                w.metrics.set_width(width)
                responses = self._next_generated()
                w.metrics.record_round(width, 0)
            except Exception as e:  # not attributable to one request: fail the batch, keep serving
                log.exception("batched generation failed")
                for job in active.values():
                    w.fail(job, failure(e))
                active.clear()
                # Closed before the next is made: each BatchGenerator puts back the wired limit it
                # found, and an old one closed (or collected) after the new one was made would unwire it.
                self.batch.close()
                self.batch = self._new_batch()
                continue
            for r in responses:
                job = active.get(r.uid)
                if job is None or job.error is not None:
                    continue
                try:
                    self._deliver(r)
                except Exception as e:  # e.g. its detokenizer or sink: this request fails alone
                    log.exception("a batched request failed")
                    job.error = e
            for uid, job in list(active.items()):  # its own sampler, processor or output raised
                if job.error is not None:
                    self.batch.remove([uid])
                    w.fail(active.pop(uid), failure(job.error))
        for job in active.values():  # closing: the jobs in flight are told so
            w.fail(job, STOPPED, 503)
        active.clear()
        self.batch.close()
        w.metrics.set_width(0)

    def _deliver(self, r) -> None:
        """One batch response to its job: its token and text, and its end if it ended."""
        w, job = self.worker, self.active[r.uid]
        # r.logprobs: the log-softmax of the row's processed logits, as generate_step's
        (logprobs,) = scored(r.logprobs, [r.token], job.params.logprobs)
        job.stats.add(Token(r.token, Provenance.PLAIN, logprobs))
        w.on_token(job, r.token, logprobs)
        reason = r.finish_reason or ("stop" if job.text.stopped else None)
        if reason is not None:
            if r.finish_reason is None:  # a stop string: the batch gives back the state it reached
                self._keep(job, self.batch.remove([r.uid], return_prompt_caches=True).get(r.uid))
            else:
                self._keep(job, (r.prompt_cache, r.all_tokens))
            w.finish_batched(job, reason)
            del self.active[r.uid]  # only once finished: if finishing raised, the caller fails it

    def _next_generated(self) -> list:
        """The batch's next generated tokens (BatchGenerator.next_generated), checkpointing each
        job whose prefill reached one of its cuts on the way."""
        active = self.active
        while True:
            prompt_responses, generated = self.batch.next()
            ends = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt and r.uid in active]
            try:
                for uid, (cache, tokens) in self.batch.extract_cache(ends).items() if ends else ():
                    if (at := len(tokens)) in active[uid].cuts:  # (the batch also stops before the last token)
                        active[uid].checkpoints[at] = Checkpoint(at, owned(recurrent_state(cache)))
            except Exception:  # a checkpoint less; the requests go on
                log.exception("cannot checkpoint a batched prompt")
            if generated or not prompt_responses:
                return generated

    def _keep(self, job: Job, state) -> None:
        """Keep a batch row's final (cache, tokens) in the prompt cache, with its checkpoints."""
        cache_store = self.worker.prefix_cache
        if state is None or cache_store is None:
            return
        cache, tokens = state
        try:
            cache_store.put(entry_from(tokens, [own_rows(c) for c in cache], job.checkpoints))
        except Exception:  # the answer matters more than keeping its state
            log.exception("cannot keep a batched request's state")

    def _admit(self, wait: bool) -> bool:
        """Move queued jobs into the batch (waiting for one when idle); False once closed."""
        w = self.worker
        while w.swap is None:  # a model swap waiting: the rows in flight end first, no new ones join
            try:
                job = w.jobs.get(block=wait)
            except queue.Empty:
                return True
            if job is None:
                return False
            wait = False
            if w.settled_in_queue(job) or w.stale(job):
                continue
            p = job.params
            if job.images is not None or (p.seed is not None and not p.greedy):
                w.run_alone(job)
                continue
            self._join(job)
        return True

    def _join(self, job: Job) -> None:
        w, p = self.worker, job.params
        job.stats = GenerationStats()
        job.started_at = time.perf_counter()
        resume = None
        try:
            resume = w.prefix_cache.take(job.prompt)  # copies, or caches handed over: the batch merges them
            at = len(resume) if resume else 0
            cuts = w.prefix_cache.plan(len(job.prompt), message_starts(job.prompt, w.marker), at)
            job.reused, job.checkpoints, job.cuts = at, dict(resume.checkpoints) if resume else {}, cuts
            (uid,) = self.batch.insert_segments(
                [_split(job.prompt, at, cuts)], max_tokens=[p.max_tokens],
                caches=[resume.trunk_cache if resume else None], all_tokens=[job.prompt[:at]],
                samplers=[guarded(plain_sampler(p, w.lm.vocab_size), job, greedy_row)],
                logits_processors=[[guarded(f, job, unchanged) for f in processors_for(p)]],
            )
        except Exception as e:  # this request alone is refused; the batch goes on
            log.exception("cannot add a request to the batch")
            if resume is not None:
                self._keep(job, (resume.trunk_cache, job.prompt[: len(resume)]))
            w.fail(job, failure(e))
            return
        self.active[uid] = job


def _split(prompt: List[int], start: int, cuts: List[int]) -> List[List[int]]:
    """The prompt after `start` as segments ending at the cuts (the batch stops at each)."""
    points = [start, *cuts, len(prompt)]
    return [prompt[a:b] for a, b in zip(points, points[1:]) if b > a]


def greedy_row(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def unchanged(_tokens: mx.array, logits: mx.array) -> mx.array:
    return logits


def guarded(fn: Callable, job: Job, fallback: Callable) -> Callable:
    """`fn` for one row of a batch: if it raises, the job records the error (it is failed after the
    step) and the row gets `fallback`'s value, so the other rows' step goes on unharmed."""

    def call(*args):
        if job.error is None:
            try:
                return fn(*args)
            except Exception as e:
                job.error = e
        return fallback(*args)

    return call
