"""From OpenAI requests to engine jobs, and from job outputs to OpenAI responses and SSE chunks.

The non-streaming response is a fold of the same outputs the stream sends, so the two carry the
same text.
"""

from typing import AsyncIterator, List, Tuple

from ...runtime import served as runtime
from ...runtime.errors import ApiError
from ...runtime.outputs import Failed, Finished, TextDelta
from ...runtime.served import ServedModel
from ...runtime.worker import Job
from ..streaming import JobStream, sse
from . import schema as api


def chat_job(served: ServedModel, req: api.ChatCompletionRequest, sink) -> Tuple[str, Job]:
    """(model id, job) for a chat request: the tokenizer's chat template, reasoning split on."""
    model_id, lm = served.current(req.model)  # one model for the whole request, even across a swap
    prompt = runtime.chat_prompt(lm, [m.for_template() for m in req.messages], req.chat_template_kwargs)
    params = runtime.checked_sampling(lm, prompt, "messages", lambda room: req.sampling(
        lm.generation_config, served.default_max_tokens, room, lm.vocab_size))
    return model_id, runtime.chat_job(lm, prompt, params, req.stop_strings(), sink)


def completion_job(served: ServedModel, req: api.CompletionRequest, sink) -> Tuple[str, Job]:
    """(model id, job) for a raw-text (or token id) completion: no template, no reasoning split."""
    model_id, lm = served.current(req.model)
    prompt = req.prompt_text_or_ids()
    if isinstance(prompt, str):
        prompt = lm.tokenizer.encode(prompt)
    elif any(not 0 <= t < lm.vocab_size for t in prompt):
        raise ApiError(400, "prompt: token ids must be in the vocabulary", param="prompt")
    params = runtime.checked_sampling(lm, prompt, "prompt", lambda room: req.sampling(
        lm.generation_config, served.default_max_tokens, room, lm.vocab_size))
    return model_id, runtime.completion_job(lm, list(prompt), params, req.stop_strings(), sink)


def _usage(done: Finished) -> api.Usage:
    return api.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)


def _failure(item: Failed) -> ApiError:
    return ApiError(item.status, item.message, kind="server_error")


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
