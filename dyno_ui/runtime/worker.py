"""The engine thread: the one thread that owns the model and makes every MLX call.

MLX streams belong to the thread that made them, and uvicorn and Gradio run handlers on pooled
threads, so handlers never touch the model: they submit a Job and receive its outputs through the
job's `sink`. Cancellation is a flag the worker reads between rounds. The playground also asks
for the engine's own events (`trace`: tokens with provenance, rounds) and runs other MLX work
(loading another model, reading memory) on this thread through `call`.

Serial mode (decode concurrency 1) runs one request at a time through the engine, drafting with
the MTP head when there is one. Batched mode (decode concurrency N > 1) drafts in batches when there
is a head (drafting_batch.py), and otherwise hands concurrent requests to mlx-lm's BatchGenerator.
Every mode reuses earlier prompts' states through one prompt cache
(speculative/prompt_cache/store.py), bounded in bytes, with an optional disk tier that outlives the
process; prefill is cut (and checkpointed) where chat messages start. Requests wait for the engine
in a queue of at most `max_queue`; past that, submit refuses them (503, Retry-After).

Memory as mlx-lm handles it (speculative/backend/memory.py), on this thread: the model wired while a
request decodes (serial) or while the batch serves (batched, as BatchGenerator holds it), MLX's
buffer cache cleared at mlx-lm's cadence and once a replaced model is let go, and the default
budgets shares of what the model leaves of the device's memory.
"""

import gc
from concurrent.futures import Future
import logging
from pathlib import Path
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from speculative.config import SamplingParams, SpecConfig
from speculative import distributed
from speculative.engine import generate, scored
from speculative.events import Done, Provenance, Round, Token, TokenLogprobs
from speculative.loader import LoadedModel
from speculative.loader.vision import ProcessedImages, vision_input
from speculative.backend.memory import MLX_MEMORY, Memory, budget_notice, default_batch_memory, device_memory, model_bytes
from speculative.round.depth_policy import DepthPolicy
from speculative.prompt_cache.store import Checkpoint, PrefixCache, entry_from, own_rows, owned, recurrent_state
from speculative.prompt_cache.disk import prompt_store
from speculative.round.processors import processors_for
from speculative.round.sampling import plain_sampler
from speculative.stats import GenerationStats

from .boundaries import message_marker, message_starts
from .drafting_batch import DraftingBatch
from .errors import STOPPED, failure, queue_full
from .logprobs import TokenBytes, described
from .metrics import Outcome, ServerMetrics
from .outputs import Failed, Finished, Traced
from .textstream import TextAssembler

log = logging.getLogger("dyno.serve")
MAX_QUEUE = 64  # requests waiting for the engine, beyond those it decodes


@dataclass
class Call:
    """A function to run on the engine thread between jobs; its result or exception goes to `future`."""

    fn: Callable[[], object]
    future: Future = field(default_factory=Future)

    def run(self) -> None:
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn())
            except BaseException as e:
                self.future.set_exception(e)


@dataclass
class Job:
    """One request as the worker sees it: token ids in, outputs to `sink` (called on the worker thread)."""

    prompt: List[int]
    params: SamplingParams
    text: TextAssembler
    sink: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: Optional[float] = None
    first_token_at: Optional[float] = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    spec: Optional[SpecConfig] = None  # None: the worker's; drafting still needs a head and serial mode
    trace: bool = False  # also send Traced engine events (before the text of each token)
    lm: Optional[LoadedModel] = None  # the model the request was checked against; must be the one served
    error: Optional[Exception] = None  # set when its sampler, processors or output raised inside a batch
    reused: int = 0  # batched: prompt tokens taken from the prompt cache
    checkpoints: Dict[int, Checkpoint] = field(default_factory=dict)  # batched: states its entry will keep
    cuts: List[int] = field(default_factory=list)  # batched: where its prefill stops to checkpoint
    images: Optional[ProcessedImages] = None  # the prompt's images (loader/vision.py); served alone, uncached

    def cancel(self) -> None:
        """Ask the worker to stop this job at the next round (or drop it if it has not started)."""
        self.cancelled.set()

    def send(self, item) -> None:
        """Pass one output to the handler; a handler that raises is logged and cannot hurt the engine."""
        try:
            self.sink(item)
        except Exception:
            log.exception("a request's handler failed")


class EngineWorker:
    """Owns the model on its own thread and serves submitted jobs.

    What a loop serving its jobs (its own, or drafting_batch.DraftingBatch) drives a job with is
    public: settled_in_queue and stale (skip a job), on_token and until (its tokens and stops),
    finish_batched and fail (its end), run_alone, and the `closing` event."""

    def __init__(self, load: Callable[[], Tuple[LoadedModel, SpecConfig]], decode_concurrency: int = 1,
                 prompt_cache_bytes: Optional[int] = None, prompt_cache_dir: Optional[Path] = None,
                 prompt_cache_disk_bytes: Optional[int] = None, max_queue: int = MAX_QUEUE,
                 max_batch_memory: Optional[int] = None,
                 depth_policy: Optional[Callable[[LoadedModel, SpecConfig], DepthPolicy]] = None,
                 memory: Memory = MLX_MEMORY):
        self.load = load  # runs on the engine thread: loading and depth tuning are MLX work too
        self.spec = SpecConfig()
        self.concurrency = decode_concurrency
        self.max_queue = max_queue
        self.max_batch_memory = max_batch_memory  # None: memory.default_batch_memory for the model
        self.memory = memory  # the MLX memory calls (wired limit, buffer cache), as mlx-lm makes them
        # Batched drafting's depth per round: made on the engine thread once the model is loaded
        # (measuring costs is MLX work); by default pinned at the depth the model was loaded with.
        self.depth_policy = depth_policy or (lambda lm, spec: DepthPolicy(None, [], pinned=spec.draft_depth))
        self.policy: Optional[DepthPolicy] = None
        # The prompt cache: made for each model once it is loaded (its disk folder is per model).
        self.prompt_cache_options = (prompt_cache_bytes, prompt_cache_dir, prompt_cache_disk_bytes)
        self.prefix_cache: Optional[PrefixCache] = None
        self.marker: Optional[int] = None  # the token that starts each chat message (boundaries.py)
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.lm: Optional[LoadedModel] = None
        self.metrics: Optional[ServerMetrics] = None  # made once the model says whether we draft
        self.running: Dict[int, Job] = {}  # jobs being generated (serial: at most one), by id
        self._ready = threading.Event()
        self.closing = threading.Event()  # stops the current generation at its next round
        self._stopped = False  # set (under _submit_lock) once the thread no longer takes jobs
        self._submit_lock = threading.Lock()
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

    def submit(self, job: Job) -> Job:
        """Queue `job`; its outputs arrive through job.sink (a Failed one at once if the engine has stopped).

        Raises ApiError (503, Retry-After) when `max_queue` requests already wait."""
        with self._submit_lock:
            if not self._stopped:
                if self.jobs.qsize() >= self.max_queue:
                    raise queue_full(self.max_queue)
                self.jobs.put(job)
                return job
        job.send(Failed(STOPPED, 503))
        return job

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread after the jobs queued before it; its result arrives in the Future."""
        call = Call(fn)
        with self._submit_lock:
            if not self._stopped:
                self.jobs.put(call)
                return call.future
        call.future.set_exception(RuntimeError(STOPPED))
        return call.future

    def replace_model(self, load: Callable[[], Tuple[LoadedModel, SpecConfig]]) -> Future:
        """Load another model on the engine thread and serve it from then on (serial mode only).

        The new model is loaded before the old one is let go, so a failed load leaves the old one.
        """
        if self.concurrency != 1:
            raise RuntimeError("the model cannot be replaced in batched mode")

        def swap():
            lm, spec = load()
            self.prefix_cache.close()  # its entries belong to the old model (to disk, if kept there)
            self.lm, self.spec, self.eos = lm, spec, lm.eos_token_ids
            self._new_prompt_cache()
            self.metrics.set_draft_depth(spec.draft_depth if self.drafting else None)
            self._let_go()
            return lm

        return self.call(swap)

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
        self.jobs.put(None)

    def close(self, timeout: float = 30.0) -> None:
        """begin_close, then wait for the thread."""
        self.begin_close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._load():
                if self.concurrency == 1:
                    self._serve_serial()  # each request wired by the engine (generate)
                elif self.drafting:
                    with self.memory.wired():
                        DraftingBatch(self).serve()
                else:
                    with self.memory.wired():  # BatchGenerator wires too; this holds it in every mode alike
                        self._serve_batched()
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
            if self.concurrency > 1 and self.drafting:
                self.policy = self.depth_policy(self.lm, self.spec)
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
        with self._submit_lock:
            self._stopped = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, Call):
                job.future.set_exception(RuntimeError(STOPPED))
            elif job is not None:
                self.fail(job, STOPPED, 503)

    def settled_in_queue(self, item) -> bool:
        """A Call runs here; a job cancelled while queued finishes without running. True for both."""
        if isinstance(item, Call):
            item.run()
            return True
        if item.cancelled.is_set():
            self._finish(item, "cancelled")
            return True
        return False

    def _serve_serial(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.settled_in_queue(job):
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
            self._finish(job, reason)

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

    def _finish(self, job: Job, reason: str) -> None:
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
        job.send(Finished(reason, len(job.prompt), n, cached))

    def fail(self, job: Job, message: str, status: int = 500) -> None:
        if self.metrics is not None:
            self.metrics.record_failure()
        job.send(Failed(message, status))

    # ---- batched mode ---------------------------------------------------------------------

    def _serve_batched(self) -> None:
        batch = self._new_batch()
        active: Dict[int, Job] = self.running  # by batch uid
        while True:
            if not self._admit(batch, active, wait=not active) or self.closing.is_set():
                break
            for uid, job in list(active.items()):
                if job.cancelled.is_set():
                    self._keep_batched(job, batch.remove([uid], return_prompt_caches=True).get(uid))
                    self.finish_batched(active.pop(uid), "cancelled")
            if not active:
                continue
            try:
                width = len(active)
                self.metrics.set_width(width)
                responses = self._next_generated(batch, active)
                self.metrics.record_round(width, 0)
            except Exception as e:  # not attributable to one request: fail the batch, keep serving
                log.exception("batched generation failed")
                for job in active.values():
                    self.fail(job, failure(e))
                active.clear()
                # Closed before the next is made: each BatchGenerator puts back the wired limit it
                # found, and an old one closed (or collected) after the new one was made would unwire it.
                batch.close()
                batch = self._new_batch()
                continue
            for r in responses:
                job = active.get(r.uid)
                if job is None or job.error is not None:
                    continue
                try:
                    self._deliver(batch, active, r)
                except Exception as e:  # e.g. its detokenizer or sink: this request fails alone
                    log.exception("a batched request failed")
                    job.error = e
            for uid, job in list(active.items()):  # its own sampler, processor or output raised
                if job.error is not None:
                    batch.remove([uid])
                    self.fail(active.pop(uid), failure(job.error))
        for job in active.values():  # closing: the jobs in flight are told so
            self.fail(job, STOPPED, 503)
        active.clear()
        batch.close()
        self.metrics.set_width(0)

    def _deliver(self, batch: BatchGenerator, active: Dict[int, Job], r) -> None:
        """One batch response to its job: its token and text, and its end if it ended."""
        job = active[r.uid]
        # r.logprobs: the log-softmax of the row's processed logits, as generate_step's
        (logprobs,) = scored(r.logprobs, [r.token], job.params.logprobs)
        job.stats.add(Token(r.token, Provenance.PLAIN, logprobs))
        self.on_token(job, r.token, logprobs)
        reason = r.finish_reason or ("stop" if job.text.stopped else None)
        if reason is not None:
            if r.finish_reason is None:  # a stop string: the batch gives back the state it reached
                self._keep_batched(job, batch.remove([r.uid], return_prompt_caches=True).get(r.uid))
            else:
                self._keep_batched(job, (r.prompt_cache, r.all_tokens))
            self.finish_batched(job, reason)
            del active[r.uid]  # only once finished: if finishing raised, the caller fails it

    def _next_generated(self, batch: BatchGenerator, active: Dict[int, Job]) -> list:
        """The batch's next generated tokens (BatchGenerator.next_generated), checkpointing each
        job whose prefill reached one of its cuts on the way."""
        while True:
            prompt_responses, generated = batch.next()
            ends = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt and r.uid in active]
            try:
                for uid, (cache, tokens) in batch.extract_cache(ends).items() if ends else ():
                    if (at := len(tokens)) in active[uid].cuts:  # (the batch also stops before the last token)
                        active[uid].checkpoints[at] = Checkpoint(at, owned(recurrent_state(cache)))
            except Exception:  # a checkpoint less; the requests go on
                log.exception("cannot checkpoint a batched prompt")
            if generated or not prompt_responses:
                return generated

    def _keep_batched(self, job: Job, state) -> None:
        """Keep a batch row's final (cache, tokens) in the prompt cache, with its checkpoints."""
        if state is None or self.prefix_cache is None:
            return
        cache, tokens = state
        try:
            self.prefix_cache.put(entry_from(tokens, [own_rows(c) for c in cache], job.checkpoints))
        except Exception:  # the answer matters more than keeping its state
            log.exception("cannot keep a batched request's state")

    def _new_batch(self) -> BatchGenerator:
        n = self.concurrency
        return BatchGenerator(self.lm.model, stop_tokens=[[t] for t in self.eos],
                              completion_batch_size=n, prefill_batch_size=n)

    def _admit(self, batch: BatchGenerator, active: Dict[int, Job], wait: bool) -> bool:
        """Move queued jobs into the batch (waiting for one when idle); False once closed."""
        while True:
            try:
                job = self.jobs.get(block=wait)
            except queue.Empty:
                return True
            if job is None:
                return False
            wait = False
            if self.settled_in_queue(job):
                continue
            if self.stale(job):
                continue
            p = job.params
            # BatchGenerator samples every row from one generator, so a seeded sampled request would
            # neither give mlx-lm's text for its seed nor leave the others' draws alone: it runs by itself.
            if job.images is not None or (p.seed is not None and not p.greedy):
                self.run_alone(job)
                continue
            job.stats = GenerationStats()
            job.started_at = time.perf_counter()
            resume = None
            try:
                resume = self.prefix_cache.take(job.prompt)  # copies, or caches handed over: the batch merges them
                at = len(resume) if resume else 0
                cuts = self.prefix_cache.plan(len(job.prompt), message_starts(job.prompt, self.marker), at)
                job.reused, job.checkpoints, job.cuts = at, dict(resume.checkpoints) if resume else {}, cuts
                (uid,) = batch.insert_segments(
                    [_split(job.prompt, at, cuts)], max_tokens=[p.max_tokens],
                    caches=[resume.trunk_cache if resume else None], all_tokens=[job.prompt[:at]],
                    samplers=[guarded(plain_sampler(p, self.lm.vocab_size), job, greedy_row)],
                    logits_processors=[[guarded(f, job, unchanged) for f in processors_for(p)]],
                )
            except Exception as e:  # this request alone is refused; the batch goes on
                log.exception("cannot add a request to the batch")
                if resume is not None:
                    self._keep_batched(job, (resume.trunk_cache, job.prompt[: len(resume)]))
                self.fail(job, failure(e))
                continue
            active[uid] = job

    def finish_batched(self, job: Job, reason: str) -> None:
        now = time.perf_counter()
        first = job.first_token_at or now
        job.stats.add(Done(reason, len(job.prompt), len(job.stats.tokens), first - job.started_at, now - first,
                           job.reused))
        self._finish(job, reason)


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
