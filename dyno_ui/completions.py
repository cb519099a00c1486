"""From OpenAI requests to engine jobs, and from job outputs to OpenAI responses and SSE chunks.

The non-streaming response is a fold of the same outputs the stream sends, so the two carry the
same text.
"""

import asyncio
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, List, Optional, Sequence, Tuple, Union

from pydantic import BaseModel

from speculative.errors import DynoError, one_line
from speculative.loader import LoadedModel

from . import openai_schema as api
from .textstream import TextAssembler, initial_channel
from .worker import EngineWorker, Failed, Finished, Job, TextDelta

Output = Union[TextDelta, Finished, Failed]
# Template arguments that would change what apply_chat_template returns (token ids) or how.
# `chat_template` too: a client's own Jinja template could run unbounded on the server.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "chat_template", "tokenize", "add_generation_prompt", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass
class ServedModel:
    """The one model a server serves: its name, its limits, and the worker that runs it."""

    id: str
    lm: LoadedModel
    worker: EngineWorker
    default_max_tokens: int
    created: int
    loading: Optional[str] = None  # the model being loaded in its place (the Models tab), if any
    _swap: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def replace(self, lm: LoadedModel) -> None:
        """Serve `lm` (named by its folder) from now on; the worker already runs it."""
        with self._swap:
            self.lm, self.id = lm, lm.path.name

    def current(self, requested) -> Tuple[str, LoadedModel]:
        """The model a request goes to: none loading, and it names this one (or none); id and model
        are read together, so a request never names one model and gets another."""
        if self.loading is not None:
            raise api.ApiError(503, f"model loading: {self.loading}; send the request again when it is "
                                    f"loaded", code="model_loading", kind="server_error")
        with self._swap:
            served_id, lm = self.id, self.lm
        if requested is not None and requested != served_id:
            raise api.ApiError(404, f"The model '{requested}' does not exist; this server serves "
                                    f"'{served_id}'", param="model", code="model_not_found")
        return served_id, lm

    def chat_job(self, req: api.ChatCompletionRequest, sink) -> Tuple[str, Job]:
        """A job for a chat request: the tokenizer's chat template, reasoning split on."""
        model_id, lm = self.current(req.model)  # one model for the whole request, even across a swap
        tok = lm.tokenizer
        messages = [m.for_template() for m in req.messages]
        kwargs = req.chat_template_kwargs or {}
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs)):
            raise api.ApiError(400, f"chat_template_kwargs: {reserved[0]!r} is set by the server",
                               param="chat_template_kwargs")
        try:
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as e:  # jinja errors, bad kwargs: the request's fault
            raise api.ApiError(400, f"cannot apply the chat template: {one_line(e)}", param="messages") from None
        params = self._sampling(lm, req, prompt, "messages")
        text = TextAssembler(tok, req.stop_strings(), split_reasoning=True,
                             initial=initial_channel(tok, prompt))
        return model_id, Job(list(prompt), params, text, sink, lm=lm)

    def completion_job(self, req: api.CompletionRequest, sink) -> Tuple[str, Job]:
        """A job for a raw-text (or token id) completion: no template, no reasoning split."""
        model_id, lm = self.current(req.model)
        prompt = req.prompt_text_or_ids()
        if isinstance(prompt, str):
            prompt = lm.tokenizer.encode(prompt)
        elif any(not 0 <= t < lm.vocab_size for t in prompt):
            raise api.ApiError(400, "prompt: token ids must be in the vocabulary", param="prompt")
        params = self._sampling(lm, req, prompt, "prompt")
        return model_id, Job(list(prompt), params, TextAssembler(lm.tokenizer, req.stop_strings()), sink, lm=lm)

    def _sampling(self, lm: LoadedModel, req: api.SamplingFields, prompt: Sequence[int], field: str):
        n, limit = len(prompt), lm.context_length
        if n == 0:
            raise api.ApiError(400, f"{field}: the prompt is empty", param=field)
        if n >= limit:
            raise api.ApiError(400, f"This model's maximum context length is {limit} tokens, but the "
                                    f"prompt has {n} tokens", param=field, code="context_length_exceeded")
        try:
            return req.sampling(lm.generation_config, self.default_max_tokens, limit - n, lm.vocab_size)
        except DynoError as e:
            raise api.ApiError(400, e.message) from None


class JobStream:
    """A submitted job's outputs as an async iterator; leaving early (client gone) cancels the job."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.queue: "asyncio.Queue[Output]" = asyncio.Queue()

    def sink(self, item: Output) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def submit(self, job: Job) -> "JobStream":
        self.job = self.worker.submit(job)  # a stopped engine answers it with Failed at once
        return self

    async def __aiter__(self) -> AsyncIterator[Output]:
        finished = False
        try:
            while not finished:
                item = await self.queue.get()
                finished = isinstance(item, (Finished, Failed))
                yield item
        finally:
            if not finished:
                self.job.cancel()


def sse(payload: Union[BaseModel, str]) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def _usage(done: Finished) -> api.Usage:
    return api.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)


def _failure(item: Failed) -> api.ApiError:
    return api.ApiError(item.status, item.message, kind="server_error")


async def chat_response(stream: JobStream, model: str) -> api.ChatCompletion:
    """The whole chat completion, folded from the job's outputs."""
    parts = {"content": [], "reasoning": []}
    async for item in stream:
        if isinstance(item, TextDelta):
            parts[item.channel].append(item.text)
        elif isinstance(item, Failed):
            raise _failure(item)
        else:
            done = item
    reasoning = "".join(parts["reasoning"])
    message = api.ChatMessageOut(content="".join(parts["content"]), reasoning_content=reasoning or None)
    return api.ChatCompletion(id=api.new_id("chatcmpl"), created=api.now(), model=model,
                              choices=[api.ChatChoice(message=message, finish_reason=done.finish_reason)],
                              usage=_usage(done))


async def chat_events(stream: JobStream, model: str, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: the role, content and reasoning deltas, the finish reason, usage, [DONE]."""
    rid, created = api.new_id("chatcmpl"), api.now()

    def chunk(delta: api.ChatDelta, finish=None, choices=True, usage=None) -> str:
        choice = [api.ChatChunkChoice(delta=delta, finish_reason=finish)] if choices else []
        return sse(api.ChatCompletionChunk(id=rid, created=created, model=model, choices=choice, usage=usage))

    yield chunk(api.ChatDelta(role="assistant", content=""))
    async for item in stream:
        if isinstance(item, TextDelta):
            field = "reasoning_content" if item.channel == "reasoning" else "content"
            yield chunk(api.ChatDelta(**{field: item.text}))
        elif isinstance(item, Failed):
            yield sse(api.error_response(_failure(item)))
        else:
            yield chunk(api.ChatDelta(), finish=item.finish_reason)
            if include_usage:
                yield chunk(api.ChatDelta(), choices=False, usage=_usage(item))
    yield sse("[DONE]")


async def completion_response(stream: JobStream, model: str) -> api.Completion:
    """The whole text completion, folded from the job's outputs."""
    text: List[str] = []
    async for item in stream:
        if isinstance(item, TextDelta):
            text.append(item.text)
        elif isinstance(item, Failed):
            raise _failure(item)
        else:
            done = item
    choice = api.CompletionChoice(text="".join(text), finish_reason=done.finish_reason)
    return api.Completion(id=api.new_id("cmpl"), created=api.now(), model=model, choices=[choice],
                          usage=_usage(done))


async def completion_events(stream: JobStream, model: str, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of text, then the finish reason, usage and [DONE]."""
    rid, created = api.new_id("cmpl"), api.now()

    def chunk(text="", finish=None, choices=True, usage=None) -> str:
        choice = [api.CompletionChoice(text=text, finish_reason=finish)] if choices else []
        return sse(api.Completion(id=rid, created=created, model=model, choices=choice, usage=usage))

    async for item in stream:
        if isinstance(item, TextDelta):
            yield chunk(item.text)
        elif isinstance(item, Failed):
            yield sse(api.error_response(_failure(item)))
        else:
            yield chunk(finish=item.finish_reason)
            if include_usage:
                yield chunk(choices=False, usage=_usage(item))
    yield sse("[DONE]")
