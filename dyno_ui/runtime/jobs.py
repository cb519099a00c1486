"""What waits for the engine thread: requests (Job) and other MLX work (Call), in one queue, in order.

Handlers run on pooled threads and never touch the model: they submit here and receive outputs
through the job's `sink`. At most `max_queue` requests wait; past that, submit refuses them (503,
Retry-After). Once the engine stops taking work, whatever is left is answered with an error.
"""

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

from speculative.config import SamplingParams, SpecConfig
from speculative.loader import LoadedModel
from speculative.loader.vision import ProcessedImages
from speculative.prompt_cache.store import Checkpoint
from speculative.stats import GenerationStats

from .errors import STOPPED, queue_full
from .outputs import Failed
from .textstream import TextAssembler

log = logging.getLogger("dyno.serve")
MAX_QUEUE = 64  # requests waiting for the engine, beyond those it decodes


@dataclass
class Call:
    """A function to run on the engine thread between jobs; its result or exception goes to `future`.

    `exclusive` (a model swap): it runs only once no request is being decoded, so a batch first
    finishes the rows it holds and takes no new ones."""

    fn: Callable[[], object]
    future: Future = field(default_factory=Future)
    exclusive: bool = False

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
    spec: Optional[SpecConfig] = None  # None: the worker's; drafting still needs a head
    trace: bool = False  # also send Traced engine events (before the text of each token)
    lm: Optional[LoadedModel] = None  # the model the request was checked against; must be the one served
    error: Optional[Exception] = None  # set when its sampler, processors or output raised inside a batch
    reused: int = 0  # batched: prompt tokens taken from the prompt cache
    checkpoints: Dict[int, Checkpoint] = field(default_factory=dict)  # batched: states its entry will keep
    cuts: List[int] = field(default_factory=list)  # batched: where its prefill stops to checkpoint
    images: Optional[ProcessedImages] = None  # the prompt's images (loader/vision.py); served alone, uncached
    copies: Optional[str] = None  # its drafts' source (on, off, only: round/copies.py); None: the server's

    def cancel(self) -> None:
        """Ask the worker to stop this job at the next round (or drop it if it has not started)."""
        self.cancelled.set()

    def send(self, item) -> None:
        """Pass one output to the handler; a handler that raises is logged and cannot hurt the engine."""
        try:
            self.sink(item)
        except Exception:
            log.exception("a request's handler failed")


Item = Union[Job, Call, None]  # None: the engine is closing


class JobQueue:
    """Jobs and calls in submission order, for the engine thread to take (`get`)."""

    def __init__(self, max_queue: int = MAX_QUEUE):
        self.max_queue = max_queue
        self._items: "queue.Queue[Item]" = queue.Queue()
        self._lock = threading.Lock()
        self._stopped = False  # set (under _lock) once the engine no longer takes work

    def submit(self, job: Job) -> Job:
        """Queue `job`; a Failed goes to it at once if the engine has stopped.

        Raises ApiError (503, Retry-After) when `max_queue` requests already wait."""
        with self._lock:
            if not self._stopped:
                if self._items.qsize() >= self.max_queue:
                    raise queue_full(self.max_queue)
                self._items.put(job)
                return job
        job.send(Failed(STOPPED, 503))
        return job

    def call(self, fn: Callable[[], object], exclusive: bool = False) -> Future:
        """Queue `fn` for the engine thread; its result arrives in the Future."""
        call = Call(fn, exclusive=exclusive)
        with self._lock:
            if not self._stopped:
                self._items.put(call)
                return call.future
        call.future.set_exception(RuntimeError(STOPPED))
        return call.future

    def get(self, block: bool = True) -> Item:
        """The next item (raises queue.Empty when not blocking and none waits); None: closing."""
        return self._items.get(block=block)

    def wake(self) -> None:
        """Wake the engine thread from a wait for work, to close."""
        self._items.put(None)

    def qsize(self) -> int:
        return self._items.qsize()

    def stop(self) -> List[Union[Job, Call]]:
        """Take no more work; returns what was still waiting, for the engine to answer."""
        with self._lock:
            self._stopped = True
        left = []
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return left
            if item is not None:
                left.append(item)
