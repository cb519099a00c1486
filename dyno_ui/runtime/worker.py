"""The engine thread: the one thread that owns the model and makes every MLX call.

MLX streams belong to the thread that made them, and uvicorn and Gradio run handlers on pooled
threads, so handlers never touch the model: they submit a Job or a Call to the worker's JobQueue
(jobs.py) and receive its outputs through the job's `sink`. Cancellation is a flag the worker reads
between rounds. The playground also asks for the engine's own events (`trace`: tokens with
provenance, rounds) and runs other MLX work (loading another model, reading memory) on this thread.

The worker owns the model's lifecycle (load, swap, close) and what every loop does with a job (its
tokens, stops, finish and failure); the loops that decode are its peers, chosen per model:
serial (decode concurrency 1, or a model split across processes: one request at a time, drafting
when there is a head), drafting_batch.DraftingBatch (concurrency N > 1 with a head: rows drafting
together, each round at the depth the policy picks, 0 included) and plain_batch.PlainBatch (N > 1
without drafting: mlx-lm's BatchGenerator). A model swap waits until no request is being decoded:
a batch finishes its rows and takes no new ones, the swap runs, and the loop for the new model takes over.

Every mode reuses earlier prompts' states through one prompt cache (speculative/prompt_cache/store.py),
bounded in bytes, with an optional disk tier that outlives the process; prefill is cut (and
checkpointed) where chat messages start.

Memory as mlx-lm handles it (speculative/backend/memory.py), on this thread: the model wired while a
request decodes (serial) or while a batch serves (batched, as BatchGenerator holds it), MLX's
buffer cache cleared at mlx-lm's cadence and once a replaced model is let go, and the default
budgets shares of what the model leaves of the device's memory.
"""

import dataclasses
import gc
from concurrent.futures import Future
import logging
from pathlib import Path
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from speculative.config import SpecConfig
from speculative import distributed
from speculative.engine import generate
from speculative.events import Done, Parked, Round, Token, TokenLogprobs
from speculative.loader import LoadedModel
from speculative.loader.vision import vision_input
from speculative.backend.memory import MLX_MEMORY, Memory, budget_notice, default_batch_memory, device_memory, model_bytes
from speculative.round.depth_policy import DepthPolicy
from speculative.prompt_cache.store import PrefixCache
from speculative.prompt_cache.disk import prompt_store
from speculative.stats import GenerationStats

from .boundaries import message_marker, message_starts
from .drafting_batch import DraftingBatch
from .errors import STOPPED, failure
from .figures import drafting_figures
from .jobs import MAX_QUEUE, Call, Job, JobQueue
from .logprobs import TokenBytes, described
from .metrics import Outcome, ServerMetrics
from .outputs import Failed, Finished, Traced
from .plain_batch import PlainBatch

__all__ = ["EngineWorker", "Job", "Call", "MAX_QUEUE"]
log = logging.getLogger("dyno.serve")


class EngineWorker:
    """Owns the model on its own thread and serves submitted jobs through the loop its model takes.

    What a loop drives a job with is public: settled_in_queue and stale (skip a job), on_token and
    until (its tokens and stops), finish, finish_batched and fail (its end), run_alone; and what it watches:
    the `closing` event, and `swap` (a model swap waiting: finish the rows in flight, take no more)."""

    def __init__(self, load: Callable[[], Tuple[LoadedModel, SpecConfig]], decode_concurrency: int = 1,
                 prompt_cache_bytes: Optional[int] = None, prompt_cache_dir: Optional[Path] = None,
                 prompt_cache_disk_bytes: Optional[int] = None, max_queue: int = MAX_QUEUE,
                 max_batch_memory: Optional[int] = None, memory: Memory = MLX_MEMORY):
        self.load = load  # runs on the engine thread: loading and depth tuning are MLX work too
        self.spec = SpecConfig()
        self.concurrency = decode_concurrency
        self.max_batch_memory = max_batch_memory  # None: memory.default_batch_memory for the model
        self.memory = memory  # the MLX memory calls (wired limit, buffer cache), as mlx-lm makes them
        # Batched drafting's depth per round: the model's (load_model decides it with the depth,
        # batched=worker.batched), else pinned at the depth it was loaded with.
        self.policy: Optional[DepthPolicy] = None
        # The prompt cache: made for each model once it is loaded (its disk folder is per model).
        self.prompt_cache_options = (prompt_cache_bytes, prompt_cache_dir, prompt_cache_disk_bytes)
        self.prefix_cache: Optional[PrefixCache] = None
        self.marker: Optional[int] = None  # the token that starts each chat message (boundaries.py)
        self.jobs = JobQueue(max_queue)
        self.swap: Optional[Call] = None  # a model swap taken from the queue, waiting for the rows in flight
        self.lm: Optional[LoadedModel] = None
        self.metrics: Optional[ServerMetrics] = None  # made once the model says whether we draft
        self.running: Dict[int, Job] = {}  # jobs being generated (serial: at most one), by id
        self._ready = threading.Event()
        self.closing = threading.Event()  # stops the current generation at its next round
        self._load_error: Optional[BaseException] = None
        self._token_bytes: Optional[TokenBytes] = None  # for log-probabilities: the served tokenizer's
        self._thread = threading.Thread(target=self._main, name="dyno-engine", daemon=True)

    @property
    def drafting(self) -> bool:
        """True when requests are decoded with MTP drafts (a head loaded, speculation not off)."""
        return self.spec.mode != "off" and self.lm is not None and self.lm.head is not None

    def start(self) -> LoadedModel:
        """Start the thread, load the model on it, and return it (load errors are raised here)."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()  # it is cleaning up MLX state; the process must not exit before
            raise self._load_error
        return self.lm

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def max_queue(self) -> int:
        return self.jobs.max_queue

    def submit(self, job: Job) -> Job:
        """Queue `job`; its outputs arrive through job.sink (a Failed one at once if the engine has stopped).

        Raises ApiError (503, Retry-After) when `max_queue` requests already wait."""
        return self.jobs.submit(job)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread after the jobs queued before it; its result arrives in the Future."""
        return self.jobs.call(fn)

    def replace_model(self, load: Callable[[], Tuple[LoadedModel, SpecConfig]]) -> Future:
        """Load another model on the engine thread and serve it from then on, once the requests queued
        before have been served (a batch finishes its rows first); later ones wait for the new model.

        The new model is loaded before the old one is let go, so a failed load leaves the old one.
        """
        def swap():
            lm, spec = load()
            policy = self._policy(lm, spec)
            self.prefix_cache.close()  # its entries belong to the old model (to disk, if kept there)
            self.lm, self.spec, self.eos, self.policy = lm, spec, lm.eos_token_ids, policy
            self._new_prompt_cache()
            self.metrics.set_draft_depth(spec.draft_depth if self.drafting else None)
            self._let_go()
            return lm

        return self.jobs.call(swap, exclusive=True)

    def release_memory(self) -> Future:
        """Once the caller has dropped its references to a replaced model: return its buffers to the
        system (on the engine thread, after the work queued before)."""
        return self.call(self._let_go)

    def _let_go(self) -> None:
        # Dropped arrays go back to MLX's buffer cache, not to the system; as mlx-lm's server does
        # before it loads another model, clear that cache so that the old model's buffers go.
        gc.collect()
        self.memory.clear_cache()

    def begin_close(self) -> None:
        """Stop at the next round of the current generation; queued jobs are then answered 503."""
        self.closing.set()
        self.jobs.wake()

    def close(self, timeout: float = 30.0) -> None:
        """begin_close, then wait for the thread."""
        self.begin_close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._load():
                while self._serve():  # a model swap waits: the loop for the new model takes over
                    swap, self.swap = self.swap, None
                    swap.run()
        finally:
            for job in self.running.values():  # only if the loop itself died: no job goes unanswered
                self.fail(job, "the engine stopped", 503)
            self._answer_queued()
            if self.prefix_cache is not None:
                try:
                    self.prefix_cache.close()  # live entries to the disk tier, if any
                except Exception:
                    log.exception("cannot save the prompt cache")
            if self.lm is not None and self.lm.ranks is not None:
                distributed.release(self.lm)  # the other ranks return from following this one
            # MLX's rule for threads: free this thread's arrays and streams before it ends, or the
            # process may abort at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _load(self) -> bool:
        """Load on this thread; a failure goes to start(), which raises it on the caller's thread."""
        try:
            self.lm, self.spec = self.load()
            self.eos = self.lm.eos_token_ids
            self.metrics = ServerMetrics(self.spec.draft_depth if self.drafting else None)
            self.metrics.watch_head(lambda: self.lm.head_health if self.lm is not None else None)
            self.policy = self._policy(self.lm, self.spec)
            self._new_prompt_cache()
            return True
        except BaseException as e:
            # Without its traceback: its frames hold what the failed load built, to be freed here.
            e.__traceback__ = e.__context__ = e.__cause__ = None
            self._load_error = e
            del e
            gc.collect()
            return False
        finally:
            self._ready.set()

    @property
    def batched(self) -> bool:
        """True when requests share rounds: what a model is loaded for (load_model's `batched`)."""
        return self.concurrency > 1

    def _policy(self, lm: LoadedModel, spec: SpecConfig) -> Optional[DepthPolicy]:
        """The depth policy batched drafting runs `lm` with (None when it does not batch drafts)."""
        if not self._batches_drafts(lm, spec):
            return None
        return spec.policy if spec.policy is not None else DepthPolicy(None, [], pinned=spec.draft_depth)

    def _batches_drafts(self, lm: LoadedModel, spec: SpecConfig) -> bool:
        """True when this worker serves `lm` by batched drafting (and needs a depth policy for it)."""
        return self.concurrency > 1 and lm.ranks is None and spec.mode != "off" and lm.head is not None

    def _serve(self) -> bool:
        """Serve jobs with the loop the model takes until the worker closes (False) or a model swap
        waits with no request in flight (True)."""
        if self.concurrency == 1 or self.lm.ranks is not None:
            self._serve_serial()  # each request wired by the engine (generate)
        else:
            # BatchGenerator wires too; this holds it in every batched mode alike
            with self.memory.wired():
                (DraftingBatch if self.drafting else PlainBatch)(self).serve()
        return self.swap is not None and not self.closing.is_set()

    def _new_prompt_cache(self) -> None:
        memory, folder, disk = self.prompt_cache_options
        self.prefix_cache = prompt_store(self.lm, memory, folder, disk, notify=log.warning)
        self.marker = message_marker(self.lm.tokenizer)
        self._check_budgets()

    def _check_budgets(self) -> None:
        """One line when the budgets given (the defaults always fit) and the model exceed the device's memory."""
        given = {"--prompt-cache-bytes": self.prompt_cache_options[0]}
        if self.concurrency > 1 and self.drafting:  # the only mode that admits rows by it
            given["--max-batch-memory"] = self.max_batch_memory
        if notice := budget_notice(self.model_bytes(), device_memory(), given):
            log.warning(notice)

    def model_bytes(self) -> int:
        """What the served model's weights and head take."""
        return model_bytes(self.lm.model, self.lm.head)

    def batch_memory(self) -> int:
        """Batched drafting's memory budget: --max-batch-memory, else memory.py's default for the model."""
        if self.max_batch_memory is not None:
            return self.max_batch_memory
        return default_batch_memory(self.model_bytes(), device_memory())

    def _answer_queued(self) -> None:
        """Once the thread stops taking work: every job still queued gets an error, every call one too."""
        for item in ([self.swap] if self.swap is not None else []) + self.jobs.stop():
            if isinstance(item, Call):
                item.future.set_exception(RuntimeError(STOPPED))
            else:
                self.fail(item, STOPPED, 503)
        self.swap = None

    def settled_in_queue(self, item) -> bool:
        """A Call runs here, but an exclusive one (a model swap) waits in `swap` for the loop to end its
        rows and return; a job cancelled while queued finishes without running. True for each."""
        if isinstance(item, Call):
            if item.exclusive:
                self.swap = item
            else:
                item.run()
            return True
        if item.cancelled.is_set():
            self.finish(item, "cancelled")
            return True
        return False

    def _serve_serial(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.settled_in_queue(job):
                if self.swap is not None:  # no request in flight between jobs: swap now
                    return
                continue
            self.run_alone(job)
            self.metrics.set_width(0)
            if self.closing.is_set():
                break

    def run_alone(self, job: Job) -> None:
        """One request served by itself: serial mode's every job, and in plain batched mode a prompt with
        images or a seeded sampled request (not rows of a batch yet: the batch waits while it decodes)."""
        self.running[id(job)] = job
        self.metrics.set_width(1)
        try:
            self._run(job)
        except Exception as e:  # this request fails alone: the thread, other jobs and cache entries live on
            log.exception("generation failed")
            self.fail(job, failure(e))
        del self.running[id(job)]

    def stale(self, job: Job) -> bool:
        """True (and the job failed) when the request was checked against a model no longer served."""
        if job.lm is None or job.lm is self.lm:
            return False
        self.fail(job, "the model was replaced while this request waited; send it again", 503)
        return True

    def _run(self, job: Job) -> None:
        """One request through the engine; stops between rounds when cancelled or a stop string hits."""
        if self.stale(job):
            return
        spec = job.spec or self.spec
        if spec.mode == "off" or self.lm.head is None:
            spec = SpecConfig("off", spec.draft_depth)
        elif job.copies is not None:
            spec = dataclasses.replace(spec, copies=job.copies)
        job.stats = GenerationStats(draft_depth=spec.draft_depth)
        split = self.lm.ranks is not None  # across mx.distributed ranks: rank 0's engine leads the others
        if split and job.images is not None:
            self.fail(job, "images are not supported on a model split across processes", 400)
            return
        # The tower runs here, on the thread that owns MLX.
        vision = vision_input(self.lm.target, self.lm.vision, job.prompt, job.images) if job.images is not None else None
        if split:  # no prompt cache; closing the stream after a stop or cancel halts every rank
            events = distributed.generate(self.lm, job.prompt, job.params, spec)
        else:
            events = generate(self.lm, job.prompt, job.params, spec, prefix_cache=self.prefix_cache,
                              boundaries=message_starts(job.prompt, self.marker), until=lambda: self.until(job),
                              memory=self.memory, vision=vision)
        reason = "cancelled"
        try:
            for event in events:
                if job.trace:
                    job.send(Traced(event, time.perf_counter()))
                job.stats.add(event)
                if isinstance(event, Round):
                    self.metrics.record_round(1, event.drafted)
                elif isinstance(event, Parked):  # a round at depth 0 (the batched loop records its own)
                    self.metrics.record_round(1, 0)
                elif isinstance(event, Token):
                    self.on_token(job, event.id, event.logprobs)
                    if split and (why := self.until(job)):
                        reason = why
                        break
                elif isinstance(event, Done):
                    reason = event.finish_reason
        finally:
            events.close()  # (if its output raised: the engine still keeps the state it reached)
        if reason == "cancelled" and self.closing.is_set() and not job.cancelled.is_set():
            self.fail(job, STOPPED, 503)  # cut by shutdown, not by its client: say so, not a finish
        else:
            self.finish(job, reason)

    def until(self, job: Job) -> Optional[str]:
        """Why the engine should end `job` after its latest token: a stop string, a cancel (its
        client's or the server's shutdown), or None to go on. The engine keeps the state it reached."""
        if job.text.stopped:
            return "stop"
        if job.cancelled.is_set() or self.closing.is_set():
            return "cancelled"
        return None

    def on_token(self, job: Job, token: int, logprobs: Optional[TokenLogprobs] = None) -> None:
        """A token's log-probabilities (when asked for), then its text; EOS delivers neither."""
        job.first_token_at = job.first_token_at or time.perf_counter()
        if token not in self.eos:
            if logprobs is not None:
                job.send(described(self._names(), token, logprobs))
            self._emit(job, job.text.add(token))

    def _names(self) -> TokenBytes:
        if self._token_bytes is None or self._token_bytes.tokenizer is not self.lm.tokenizer:
            self._token_bytes = TokenBytes(self.lm.tokenizer)
        return self._token_bytes

    def _emit(self, job: Job, pieces) -> None:
        for piece in pieces:  # TextDelta and ToolCallDelta, from the job's TextAssembler
            job.send(piece)

    def finish(self, job: Job, reason: str) -> None:
        """Flush held-back text, log the request's line, count it, and tell the handler.

        Counting comes after the last step that can raise, so a request is counted once: finished
        here, or failed by the caller."""
        if reason != "cancelled":
            self._emit(job, job.text.finish())
            if job.text.stopped:  # the stop string was in text held back until now (partial UTF-8)
                reason = "stop"
        done = job.stats.done
        cached = done.reused_prompt_tokens if done else 0
        n = len(job.stats.tokens)
        log.info(job.stats.summary_line())
        now = time.perf_counter()
        self.metrics.record(Outcome(
            stats=job.stats, finish_reason=reason, prompt_tokens=len(job.prompt), cached_tokens=cached,
            latency_s=now - job.submitted_at,
            ttft_s=None if job.first_token_at is None else job.first_token_at - job.submitted_at,
        ))
        figures = drafting_figures(job.stats, self.drafts(job), len(job.prompt), cached)
        job.send(Finished(reason, len(job.prompt), n, cached, figures))

    def drafts(self, job: Job) -> bool:
        """True when `job` was served drafting: a head loaded, and neither the server nor the request
        (its own spec: the playground's mode, an API's `draft: false`) turned drafting off."""
        spec = job.spec or self.spec
        return spec.mode != "off" and self.lm is not None and self.lm.head is not None and (
            self.concurrency == 1 or self.lm.ranks is not None or self.drafting)

    def fail(self, job: Job, message: str, status: int = 500) -> None:
        if self.metrics is not None:
            self.metrics.record_failure()
        job.send(Failed(message, status))

    # ---- what every loop does with a job's end ----

    def finish_batched(self, job: Job, reason: str) -> None:
        """A plain batched row's end (the drafting loop's rows get their Done from the engine)."""
        now = time.perf_counter()
        first = job.first_token_at or now
        job.stats.add(Done(reason, len(job.prompt), len(job.stats.tokens), first - job.started_at, now - first,
                           job.reused))
        self.finish(job, reason)
