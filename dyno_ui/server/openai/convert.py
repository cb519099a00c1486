"""From OpenAI requests to engine jobs, and from job outputs to OpenAI responses and SSE chunks.

The non-streaming response is a fold of the same outputs the stream sends, so the two carry the
same text.
"""

from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Tuple

from ...runtime import chat
from ...runtime import served as runtime
from ...runtime.errors import ApiError
from ...runtime.outputs import Failed, Finished, TextDelta, TokenLogprob, ToolCallDelta
from ...runtime.request import ChatRequest, JsonSchema
from ...runtime.served import ServedModel
from ...runtime.worker import Job
from ..streaming import JobStream, sse
from . import schema as api


def chat_request(req: api.ChatCompletionRequest) -> ChatRequest:
    """The request in the runtime's terms: messages, tools, tool_choice resolved, response_format as a
    schema, reasoning_effort as a thinking budget."""
    return ChatRequest(
        messages=tuple(m.message() for m in req.messages), model=req.model,
        tools=tuple(t.tool() for t in req.tools or ()), tool_choice=req.choice(),
        parallel_tool_calls=req.parallel_tool_calls is not False, response_format=format_spec(req.response_format),
        template_kwargs=req.chat_template_kwargs or {}, thinking_budget=req.thinking_budget(),
        sampling=req.sampling(), stop=tuple(req.stop_strings()), draft=req.draft, copies=req.copies)


def chat_job(served: ServedModel, req: api.ChatCompletionRequest, sink) -> Tuple[str, Job]:
    """(model id, job) for a chat request: the tokenizer's chat template (with the tools offered),
    reasoning split on, tool calls parsed, the answer held to a forced call or the response format."""
    return chat.job_for(served, chat_request(req), sink)


def format_spec(response_format: Any) -> Optional[JsonSchema]:
    """`response_format` as the JSON the answer follows; None for text or absent.

    {"type": "json_object"} is any JSON object; {"type": "json_schema", "json_schema": {"schema":
    ..., "strict": ...}} is the schema, enforced whatever `strict` says (a schema-less json_schema is
    any JSON object, as vLLM reads it). Anything else is a 400 naming the problem.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise _bad_format("must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonSchema()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise _bad_format("json_schema must be an object with a schema")
        return JsonSchema(spec.get("schema"))
    raise _bad_format(f"type must be text, json_object or json_schema, got {kind!r}")


def _bad_format(why: str) -> ApiError:
    return ApiError(400, f"invalid response_format: {why}", param="response_format")


def completion_job(served: ServedModel, req: api.CompletionRequest, sink) -> Tuple[str, Job]:
    """(model id, job) for a raw-text (or token id) completion: no template, no reasoning split."""
    model_id, lm = served.current(req.model)
    prompt = req.prompt_text_or_ids()
    if isinstance(prompt, str):
        prompt = lm.tokenizer.encode(prompt)
    elif any(not 0 <= t < lm.vocab_size for t in prompt):
        raise ApiError(400, "prompt: token ids must be in the vocabulary", param="prompt")
    params = runtime.checked_sampling(lm, prompt, "prompt", req.sampling(), served.default_max_tokens)
    return model_id, runtime.completion_job(lm, list(prompt), params, req.stop_strings(), sink, req.draft,
                                                   req.copies)


def _usage(done: Finished) -> api.Usage:
    return api.usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)


def _failure(item: Failed) -> ApiError:
    return ApiError(item.status, item.message, kind="server_error")


# JSON has no -inf (a token a grammar or logit bias excludes); as vLLM, such values are sent as this.
FLOOR_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, FLOOR_LOGPROB)


def _wants_logprobs(stream: JobStream) -> bool:
    return stream.job.params.logprobs is not None


def _chat_logprobs(items: List[TokenLogprob]) -> api.ChatLogprobs:
    """OpenAI's chat logprobs: every token delivered (content, reasoning and tool-call tokens alike)."""
    return api.ChatLogprobs(content=[api.ChatTokenLogprob(
        token=t.token, logprob=_logprob(t.logprob), bytes=list(t.bytes),
        top_logprobs=[api.TopLogprob(token=a.token, logprob=_logprob(a.logprob), bytes=list(a.bytes)) for a in t.top],
    ) for t in items])


def _completion_logprobs(items: List[TokenLogprob], offset: int = 0) -> Tuple[api.CompletionLogprobs, int]:
    """OpenAI's completions logprobs and the text offset after them; offsets count the tokens'
    own strings from the start of the completion (`offset` where this chunk starts)."""
    out = api.CompletionLogprobs()
    for t in items:
        out.tokens.append(t.token)
        out.token_logprobs.append(_logprob(t.logprob))
        out.top_logprobs.append({a.token: _logprob(a.logprob) for a in t.top})
        out.text_offset.append(offset)
        offset += len(t.token)
    return out, offset


def _finish_reason(done: Finished, called: bool) -> str:
    """OpenAI's finish reason: an answer that ended after calling tools ends with "tool_calls"."""
    return "tool_calls" if called and done.finish_reason == "stop" else done.finish_reason


async def chat_response(stream: JobStream, model: str) -> api.ChatCompletion:
    """The whole chat completion, folded from the job's outputs."""
    parts = {"content": [], "reasoning": []}
    calls: Dict[int, Tuple[str, str, List[str]]] = {}  # index -> (id, name, argument pieces)
    scores: List[TokenLogprob] = []
    async for item in stream:
        if isinstance(item, TextDelta):
            parts[item.channel].append(item.text)
        elif isinstance(item, TokenLogprob):
            scores.append(item)
        elif isinstance(item, ToolCallDelta):
            calls.setdefault(item.index, (item.id, item.name, []))[2].append(item.arguments)
        elif isinstance(item, Failed):
            raise _failure(item)
        else:
            done = item
    reasoning, content = "".join(parts["reasoning"]), "".join(parts["content"])
    tool_calls = [api.ToolCallOut(id=i, function=api.FunctionOut(name=name, arguments="".join(pieces)))
                  for i, name, pieces in (calls[k] for k in sorted(calls))]
    message = api.ChatMessageOut(content=content if content or not tool_calls else None,
                                 reasoning_content=reasoning or None, tool_calls=tool_calls or None)
    choice = api.ChatChoice(message=message, finish_reason=_finish_reason(done, bool(tool_calls)),
                            logprobs=_chat_logprobs(scores) if _wants_logprobs(stream) else None)
    return api.ChatCompletion(id=api.new_id("chatcmpl"), created=api.now(), model=model, choices=[choice],
                              usage=_usage(done), drafting=done.drafting)


def _call_chunk(item: ToolCallDelta) -> api.ToolCallChunk:
    """A call's first chunk carries its id, type and name; the others only arguments."""
    if item.id is None:
        return api.ToolCallChunk(index=item.index, function=api.FunctionDelta(arguments=item.arguments))
    return api.ToolCallChunk(index=item.index, id=item.id, type="function",
                             function=api.FunctionDelta(name=item.name, arguments=item.arguments))


async def chat_events(stream: JobStream, model: str, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks: the role, content, reasoning and tool-call deltas, the finish reason, usage, [DONE]."""
    rid, created = api.new_id("chatcmpl"), api.now()
    called = False
    # Token log-probabilities wait for the next chunk (text, a call or the finish): a token's text
    # may be held back (a partial character, a possible stop string), so they go out no earlier.
    scores: Optional[List[TokenLogprob]] = [] if _wants_logprobs(stream) else None

    def chunk(delta: api.ChatDelta, finish=None, choices=True, usage=None, drafting=None) -> str:
        logprobs = None
        if choices and scores:
            logprobs = _chat_logprobs(scores)
            scores.clear()
        choice = [api.ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)] if choices else []
        return sse(api.ChatCompletionChunk(id=rid, created=created, model=model, choices=choice, usage=usage,
                                           drafting=drafting))

    yield chunk(api.ChatDelta(role="assistant", content=""))
    async for item in stream:
        if isinstance(item, TokenLogprob):
            if scores is not None:
                scores.append(item)
        elif isinstance(item, TextDelta):
            field = "reasoning_content" if item.channel == "reasoning" else "content"
            yield chunk(api.ChatDelta(**{field: item.text}))
        elif isinstance(item, ToolCallDelta):
            called = True
            yield chunk(api.ChatDelta(tool_calls=[_call_chunk(item)]))
        elif isinstance(item, Failed):
            yield sse(api.error_response(_failure(item)))
        else:  # the figures ride on the last chunk: the usage chunk when asked for, else the finish
            yield chunk(api.ChatDelta(), finish=_finish_reason(item, called),
                        drafting=None if include_usage else item.drafting)
            if include_usage:
                yield chunk(api.ChatDelta(), choices=False, usage=_usage(item), drafting=item.drafting)
    yield sse("[DONE]")


async def completion_response(stream: JobStream, model: str) -> api.Completion:
    """The whole text completion, folded from the job's outputs."""
    text: List[str] = []
    scores: List[TokenLogprob] = []
    async for item in stream:
        if isinstance(item, TextDelta):
            text.append(item.text)
        elif isinstance(item, TokenLogprob):
            scores.append(item)
        elif isinstance(item, Failed):
            raise _failure(item)
        else:
            done = item
    logprobs = _completion_logprobs(scores)[0] if _wants_logprobs(stream) else None
    choice = api.CompletionChoice(text="".join(text), finish_reason=done.finish_reason, logprobs=logprobs)
    return api.Completion(id=api.new_id("cmpl"), created=api.now(), model=model, choices=[choice],
                          usage=_usage(done), drafting=done.drafting)


async def completion_events(stream: JobStream, model: str, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of text, then the finish reason, usage and [DONE]."""
    rid, created = api.new_id("cmpl"), api.now()
    scores: Optional[List[TokenLogprob]] = [] if _wants_logprobs(stream) else None  # as in chat_events
    offset = 0

    def chunk(text="", finish=None, choices=True, usage=None, drafting=None) -> str:
        nonlocal offset
        logprobs = None
        if choices and scores:
            logprobs, offset = _completion_logprobs(scores, offset)
            scores.clear()
        choice = [api.CompletionChoice(text=text, finish_reason=finish, logprobs=logprobs)] if choices else []
        return sse(api.Completion(id=rid, created=created, model=model, choices=choice, usage=usage,
                                  drafting=drafting))

    async for item in stream:
        if isinstance(item, TokenLogprob):
            if scores is not None:
                scores.append(item)
        elif isinstance(item, TextDelta):
            yield chunk(item.text)
        elif isinstance(item, Failed):
            yield sse(api.error_response(_failure(item)))
        else:  # as in chat_events, the figures on the last chunk
            yield chunk(finish=item.finish_reason, drafting=None if include_usage else item.drafting)
            if include_usage:
                yield chunk(choices=False, usage=_usage(item), drafting=item.drafting)
    yield sse("[DONE]")
