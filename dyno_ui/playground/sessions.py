"""What the playground's callbacks do, without Gradio widgets: jobs in, Traces out.

Callbacks run on Gradio's pooled threads; everything that touches MLX goes to the engine thread,
as a traced Job or through `worker.call`. One job per browser session can be stopped.
"""

import queue
from collections import OrderedDict
import resource
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from speculative.config import SamplingParams, SpecConfig
from speculative.errors import DynoError
from speculative.loader.source import ModelSource, cache_repo_id, is_repo_id
from speculative.loader.vision import ProcessedImages, checked_vision, process_images
from speculative.round.copies import check_source

from ..paths import local_folders
from ..runtime.keys import key_matches
from ..runtime.served import ServedModel, chat_job
from ..runtime.worker import Job
from .trace import Trace

KEPT = 256  # sessions' last answers and races kept for export and replay
FRAME_S = 0.2  # the answer and stats while streaming; the conversation and charts every CHART_S
CHART_S = 0.5


class Sessions:
    """The playground's access to the served model: chat and compare jobs, stopping, model management."""

    def __init__(self, served: ServedModel, api_key: Optional[str] = None):
        self.served = served
        self.api_key = api_key  # --api-key: the page's login asks for it; model management checks it again
        self.running: Dict[str, Job] = {}
        self.kept: "OrderedDict[tuple, object]" = OrderedDict()  # (session, what) -> its last finished Trace(s)

    @property
    def lm(self):
        return self.served.lm

    # ---- settings ------------------------------------------------------------------------

    def defaults(self) -> SamplingParams:
        """The model's generation_config sampling values (greedy where it has none)."""
        return self.served.defaults()

    # A callback reads `self.lm` once and passes it to each step (lm=...), so a model swapped in
    # meanwhile never serves a prompt built for another; the worker fails such a job (Job.lm).

    def params(self, temperature, top_p, top_k, min_p, max_tokens, seed, prompt_len: int,
               lm=None) -> SamplingParams:
        """Validated sampling values from the sliders; max_tokens capped by the context left."""
        room = (lm or self.lm).context_length - prompt_len
        if room < 1:
            raise DynoError(f"the conversation ({prompt_len} tokens) fills the model's context")
        seed = None if seed is None or seed == "" or int(seed) < 0 else int(seed)
        return SamplingParams(float(temperature), float(top_p), int(top_k), float(min_p),
                              min(int(max_tokens), room), seed)

    def spec(self, mode: str, depth, lm=None, details: bool = False) -> SpecConfig:
        """The job's speculation; `mtp` on a model without a head is the user's error."""
        lm = lm or self.lm
        if mode == "mtp" and lm.head is None:
            raise DynoError(f"{lm.name} has no MTP head: choose auto or off, or fetch a head")
        return SpecConfig(mode, int(depth), details=bool(details))

    def copies(self, copies) -> str:
        """The page's draft sources for its requests (on, off, only: round/copies.py), else a one-line error."""
        try:
            return check_source(copies)
        except ValueError as e:
            raise DynoError(str(e)) from None

    def chat_prompt(self, messages: Sequence[dict], thinking: bool, lm=None) -> List[int]:
        """Token ids of the conversation through the tokenizer's chat template."""
        try:
            ids = (lm or self.lm).tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                        enable_thinking=bool(thinking))
        except Exception as e:
            raise DynoError(f"cannot apply the chat template: {e}") from None
        return list(ids)

    def with_images(self, ids: List[int], files: Sequence[str], lm=None) -> Tuple[List[int], Optional[ProcessedImages]]:
        """(token ids with each image placeholder widened to its rows, the processed images) for a prompt
        whose placeholders stand for the image `files` in order; (ids, None) without files. A model that
        takes no images, and a bad image, are DynoErrors saying what is wrong (checked as the API checks them)."""
        if not files:
            return ids, None
        vision = checked_vision(lm or self.lm)
        return process_images(vision, ids, image_files(files, self.served.images.limits), self.served.images.limits)

    # ---- generating ----------------------------------------------------------------------

    def stream(self, prompt: List[int], params: SamplingParams, spec: SpecConfig,
               session: Optional[str], lm=None, images: Optional[ProcessedImages] = None,
               copies: Optional[str] = None) -> Iterator[Trace]:
        """Run one traced job (`images`: the prompt's, from with_images; `copies`: its draft sources, None:
        the server's); yield its Trace every FRAME_S and once finished. Leaving early stops it."""
        inbox: "queue.Queue[object]" = queue.Queue()
        lm = lm or self.lm
        job = chat_job(lm, prompt, params, [], inbox.put, spec=spec, trace=True, images=images, copies=copies)
        trace = Trace(job.submitted_at, decode=lm.tokenizer.decode)  # decode: refused drafts' text
        if session is not None:
            self.running[session] = job
        self.served.worker.submit(job)
        try:
            shown = 0.0
            while not trace.finished:
                try:
                    trace.add(inbox.get(timeout=FRAME_S))
                    while True:
                        trace.add(inbox.get_nowait())
                except queue.Empty:
                    pass
                now = time.perf_counter()
                if now - shown >= FRAME_S or trace.finished:
                    shown = now
                    yield trace
        finally:
            if not trace.finished:
                job.cancel()
            if session is not None and self.running.get(session) is job:
                del self.running[session]

    def keep(self, session: Optional[str], what: str, value) -> None:
        """Remember a session's last finished answer or race (for export and replay); the oldest go first."""
        self.kept[(session, what)] = value
        self.kept.move_to_end((session, what))
        while len(self.kept) > KEPT:
            self.kept.popitem(last=False)

    def last(self, session: Optional[str], what: str):
        """What `keep` remembered for the session, or None."""
        return self.kept.get((session, what))

    def stop(self, session: Optional[str]) -> bool:
        """Cancel the session's running job (it ends at the next round); False when none runs."""
        job = self.running.get(session) if session is not None else None
        if job is None:
            return False
        job.cancel()
        return True

    def decode(self, ids: Sequence[int]) -> str:
        return self.lm.tokenizer.decode(list(ids))

    # ---- models --------------------------------------------------------------------------

    def on_engine(self, fn: Callable[[], object], timeout: Optional[float] = None):
        """fn's result, run on the engine thread (after queued jobs)."""
        return self.served.worker.call(fn).result(timeout)

    def local_models(self, folders: Sequence[str] = ()) -> List[tuple]:
        """(folder, type, head status) rows; read here, not on the engine thread: the head checks read
        only file names and headers, so listing never waits for (or holds up) a generation."""
        from speculative.heads.store import local_models

        extra = [Path(f).expanduser() for f in folders if f]
        return local_models(local_folders(extra), notify=lambda m: None)

    def authorize(self, key: Optional[str]) -> None:
        """Model management (a swap stops the API for every client) needs the server's key, when it has one."""
        if self.api_key and not key_matches(self.api_key, key):
            raise DynoError("this server requires its API key (--api-key) to load models or fetch heads: "
                            "sign in to the playground with it")

    def load(self, path: str, notify: Callable[[str], None], head_bits=None, key: Optional[str] = None):
        """A Future of the model at `path` (a folder or a Hugging Face repo id, downloaded if need be) replacing
        the served one (loaded on the engine thread), its head kept at `head_bits` (16, 8, 4; None or "auto":
        follow the trunk); `key`: the server's API key."""
        from speculative import load_model
        from speculative.heads.precision import parse_head_bits

        self.authorize(key)
        parse_head_bits(head_bits)  # a bad value fails here, not on the engine thread
        path = str(path).strip()

        def load():
            return load_model(path, notify=notify, head_bits=head_bits,  # the defaults, as `dyno serve`'s
                              batched=self.served.worker.batched)

        # Until the swap, API requests get a 503 "model loading"; one checked against the old model
        # but queued after the swap is failed by the worker (Job.lm), never served by the new one.
        repo = path if is_repo_id(path) else cache_repo_id(path)
        self.served.loading = ModelSource(Path(path).expanduser(), repo).name  # as /v1/models will name it
        try:
            future = self.served.worker.replace_model(load)
        except BaseException:
            self.served.loading = None
            raise

        def swapped(f):  # on the engine thread right after the swap (or here, if already swapped)
            if f.exception() is None:
                self.served.replace(f.result())
            self.served.loading = None
        future.add_done_callback(swapped)
        return future

    def fetch_head(self, path: str, notify: Callable[[str], None], head_bits=None, key: Optional[str] = None):
        """A Future of (head folder, base repo, memory it takes at `head_bits`) for the model at `path`
        (fetched on the engine thread); `key`: the server's API key."""
        from speculative.heads.store import planned_memory, pull_head

        self.authorize(key)
        def fetch():
            target, base = pull_head(path, None, notify)
            return target, base, planned_memory(path, target, base, head_bits)

        return self.served.worker.call(fetch)

    def describe(self) -> str:
        """The current model, its head, drafting depth and memory, as Markdown."""
        import mlx.core as mx

        from speculative.heads.precision import format_bytes

        lm, worker = self.lm, self.served.worker
        try:
            active, peak = self.on_engine(lambda: (mx.get_active_memory(), mx.get_peak_memory()), timeout=2)
            mlx_mem = f"MLX memory {active / 2**20:.0f} MiB (peak {peak / 2**20:.0f} MiB)"
        except Exception:
            mlx_mem = "MLX memory: engine busy"
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
        memory = lm.head_memory
        head = (f"MTP head: {format_bytes(memory.bytes)}, {memory.precision}, from `{memory.source}`, draft depth "
                f"{worker.spec.draft_depth}") if memory is not None else "no MTP head: plain decoding"
        return f"**{lm.name}** · `{lm.path}`  \n{head}  \n{mlx_mem} · process peak RSS {rss:.0f} MiB"


def image_files(paths: Sequence[str], limits) -> List[bytes]:
    """The bytes of uploaded image files, in order; one over the byte limit is refused before it is read."""
    if len(paths) > limits.max_images:
        raise DynoError(f"{len(paths)} images in the conversation, over the limit of {limits.max_images}")
    out = []
    for i, path in enumerate(paths, 1):
        size = Path(path).stat().st_size
        if size > limits.max_bytes:
            raise DynoError(f"image {i} is {size} bytes, over the limit of {limits.max_bytes}")
        out.append(Path(path).read_bytes())
    return out
