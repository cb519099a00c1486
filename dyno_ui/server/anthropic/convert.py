"""From Anthropic requests to engine jobs, and from job outputs to Anthropic messages and stream events.

The conversation goes through the tokenizer's chat template as the model expects it: `system`
first, assistant `tool_use` blocks as the template's tool calls, `tool_result` blocks as tool
messages, thinking blocks as the assistant's reasoning, and the tools in OpenAI's function form,
which Qwen's templates render. What lies under the APIs is shared with the OpenAI routes
(runtime/tools.py): the tool checks, the grammar of a forced call (tool_choice any or a named
tool) or of output_config.format, and the parsing of the model's tool calls (runtime/parsers).
The non-streaming message is a fold of the same events the stream sends.
"""

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional

from speculative.config import SamplingParams
from speculative.constraints import json_schema_constraint

from ...runtime import served as runtime
from ...runtime import tools as runtime_tools
from ...runtime.errors import ApiError, bad_request
from ...runtime.outputs import Failed, Finished, TextDelta, ToolCallDelta
from ...runtime.served import ServedModel
from ...runtime.worker import Job
from ..streaming import JobStream, sse
from . import schema as api

# ---- requests ------------------------------------------------------------------------------


def template_messages(req: api.Conversation, messages: Optional[List[api.Message]] = None) -> List[dict]:
    """The conversation (`messages`, else the request's) as chat-template messages (OpenAI's shape,
    which Qwen's templates read)."""
    out = [{"role": "system", "content": req.system_text()}] if req.system is not None else []
    for message in req.messages if messages is None else messages:
        if message.role == "assistant":
            out.append(_assistant(message.blocks()))
            continue
        text: List[str] = []  # a run of text blocks is one user turn, blocks a paragraph apart
        for block in message.blocks():  # tool results and text, in their order
            if isinstance(block, api.ToolResultBlock):
                if text:
                    out.append({"role": "user", "content": "\n\n".join(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            else:
                text.append(block.text)
        if text:
            out.append({"role": "user", "content": "\n\n".join(text)})
    return out


def _assistant(blocks) -> dict:
    text = "".join(b.text for b in blocks if isinstance(b, api.TextBlock))
    message = {"role": "assistant", "content": text}
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, api.ThinkingBlock))
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if isinstance(b, api.ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
    return message


def template_tools(tools: Optional[List[api.Tool]]) -> Optional[List[dict]]:
    """Anthropic tools in OpenAI's function form: what chat templates and the runtime's parsers read."""
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]


@dataclass
class Prompt:
    """A request checked against the served model: the model, the templated prompt, the tools in play."""

    model: str  # the id the request named (one of the served ids)
    lm: Any
    tokens: List[int]
    tools: Optional[List[dict]]  # template form
    choice: Any  # Anthropic's tool_choice as a dict (speculative.constraints reads its forms)


def prompt_for(served: ServedModel, req: api.Conversation) -> Prompt:
    """Pick the model, check the tools, and apply the chat template (with the tools when they may be called)."""
    _, lm = served.current(req.model)
    prefill = prefill_text(req)
    # A final assistant message is the answer's start, not a turn (empty: the answer starts afresh).
    messages = req.messages[:-1] if req.messages[-1].role == "assistant" else req.messages
    if not messages:
        raise ApiError(400, "messages: a final assistant message (prefill) needs a user message before it",
                       param="messages")
    tools = template_tools(req.tools)
    choice = req.tool_choice.model_dump() if req.tool_choice else {"type": "auto"}
    forced = req.tool_choice is not None and req.tool_choice.forced
    if forced and not tools:
        raise ApiError(400, f"tool_choice: {req.tool_choice.type!r} requires a tool call but no tools were given",
                       param="tool_choice")
    if prefill and (forced or req.output_schema is not None):
        raise ApiError(400, "messages: a final assistant message (prefill) cannot be combined with a forced "
                            "tool_choice or output_config.format, whose grammar starts the answer", param="messages")
    if prefill and req.thinking is not None and req.thinking.type == "enabled":
        raise ApiError(400, "messages: a final assistant message (prefill) cannot be combined with thinking "
                            "enabled, as in Anthropic's API: a prefill starts the text answer", param="messages")
    with bad_request("tools"):
        runtime_tools.check_tools(lm, tools, choice)
    kwargs = {}
    if req.thinking is not None and req.thinking.type != "adaptive":  # adaptive: the template's default
        kwargs["enable_thinking"] = req.thinking.type == "enabled"
    if prefill:  # the prefill is the text answer's start: the template closes its think block first
        kwargs["enable_thinking"] = False
    # tool_choice none: the model is not told about tools (as the OpenAI routes do for "none").
    offered = tools if runtime_tools.calls_allowed(tools, choice) else None
    tokens = runtime.chat_prompt(lm, template_messages(req, messages), kwargs, offered, prefill)
    return Prompt(req.model, lm, tokens, tools, choice)


def prefill_text(req: api.Conversation) -> str:
    """The text of a final assistant message, which the answer continues (Anthropic's prefill); "" if none.

    As Anthropic's API: text blocks only, and no trailing whitespace (a model continues a word, or
    starts one after a space it writes itself)."""
    last = req.messages[-1]
    if last.role != "assistant":
        return ""
    blocks = last.blocks()
    if not all(isinstance(b, api.TextBlock) for b in blocks):
        raise ApiError(400, "messages: a final assistant message (prefill) may hold text blocks only",
                       param="messages")
    text = "".join(b.text for b in blocks)
    if text != text.rstrip():
        raise ApiError(400, "messages: final assistant content cannot end with trailing whitespace",
                       param="messages")
    return text


def count_tokens(served: ServedModel, req: api.CountTokensRequest) -> int:
    """Tokens of the prompt /v1/messages would build for the same conversation."""
    return len(prompt_for(served, req).tokens)


def message_job(served: ServedModel, req: api.MessagesRequest, sink) -> "Reply":
    """The job for a request, with the Reply that turns its outputs into events. A forced tool call
    (any, or a named tool) and output_config.format are grammars (after the reasoning the template
    opened, if any): drafting stays on and the answer is valid against the schema."""
    prompt = prompt_for(served, req)
    lm, tools, choice = prompt.lm, prompt.tools, prompt.choice
    parallel = not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    with bad_request("output_config"):
        response = json_schema_constraint(req.output_schema, lm) if req.output_schema is not None else None
    with bad_request("tool_choice"):
        constraint = runtime_tools.answer_constraint(lm, prompt.tokens, tools, choice, parallel, response)

    def sampling(room: int) -> SamplingParams:
        return SamplingParams.from_generation_config(
            lm.generation_config, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            max_tokens=min(req.max_tokens, room), constraint=constraint)

    params = runtime.checked_sampling(lm, prompt.tokens, "messages", sampling)
    calls = runtime_tools.tool_call_stream(lm, tools, choice, parallel)
    job = runtime.chat_job(lm, prompt.tokens, params, req.stop_strings(), sink, tool_calls=calls)
    return Reply(prompt.model, job)


# ---- outputs -------------------------------------------------------------------------------


class Reply:
    """One request's job outputs as Anthropic stream events: a content block opened, extended and
    closed for each run of reasoning (thinking), content (text) and each tool call (tool_use)."""

    def __init__(self, model: str, job: Job):
        self.model, self.job = model, job
        self.id = api.new_id("msg")
        self.index = -1
        self.open: Optional[str] = None  # type of the block being written
        self.calls: Dict[int, int] = {}  # the answer's tool call index -> its block's index

    def start(self) -> api.MessageStart:
        """message_start: the prompt's size (the share reused from a cache is known when the job ends)."""
        usage = api.Usage(input_tokens=len(self.job.prompt), output_tokens=0)
        return api.MessageStart(message=api.MessageOut(id=self.id, model=self.model, content=[], usage=usage))

    def on(self, item) -> List[api.Event]:
        """The events one job output makes."""
        if isinstance(item, TextDelta):
            return self._write("thinking" if item.channel == "reasoning" else "text", item.text)
        if isinstance(item, ToolCallDelta):
            return self._call(item)
        if isinstance(item, Failed):
            return [api.error_response(ApiError(item.status, item.message))]
        return self._close() + [api.MessageDelta(delta=self._stop(item), usage=usage(item)), api.MessageStop()]

    def _call(self, item: ToolCallDelta) -> List[api.Event]:
        events = []
        if item.index not in self.calls:  # its first piece: the name (the runtime's call id is OpenAI-shaped)
            events = self._close() + self._open(api.ToolUseOut(id=api.new_id("toolu"), name=item.name or "",
                                                               input={}))
            self.calls[item.index] = self.index
        if item.arguments:
            events.append(api.ContentBlockDelta(index=self.calls[item.index],
                                                delta=api.InputJsonDeltaOut(partial_json=item.arguments)))
        return events

    def _write(self, kind: str, text: str) -> List[api.Event]:
        if not text:
            return []
        events = []
        if self.open != kind:
            block = api.ThinkingOut(thinking="") if kind == "thinking" else api.TextOut(text="")
            events = self._close() + self._open(block)
        delta = api.ThinkingDeltaOut(thinking=text) if kind == "thinking" else api.TextDeltaOut(text=text)
        return events + [api.ContentBlockDelta(index=self.index, delta=delta)]

    def _open(self, block) -> List[api.Event]:
        self.index += 1
        self.open = block.type
        return [api.ContentBlockStart(index=self.index, content_block=block)]

    def _close(self) -> List[api.Event]:
        if self.open is None:
            return []
        self.open = None
        return [api.ContentBlockStop(index=self.index)]

    def _stop(self, done: Finished) -> api.StopDelta:
        if done.finish_reason == "length":
            return api.StopDelta(stop_reason="max_tokens")
        stop = self.job.text.matched_stop()
        if stop is not None:
            return api.StopDelta(stop_reason="stop_sequence", stop_sequence=stop)
        return api.StopDelta(stop_reason="tool_use" if self.calls else "end_turn")


def usage(done: Finished) -> api.Usage:
    """Anthropic's counts: input_tokens are the prompt tokens not read from the prefix cache."""
    return api.Usage(input_tokens=done.prompt_tokens - done.cached_tokens, output_tokens=done.completion_tokens,
                     cache_read_input_tokens=done.cached_tokens)


async def events(stream: JobStream, reply: Reply) -> AsyncIterator[str]:
    """The SSE stream: message_start, the content blocks, message_delta, message_stop (or an error event)."""
    yield _sse(reply.start())
    async for item in stream:
        for event in reply.on(item):
            yield _sse(event)


def _sse(event) -> str:
    return sse(event, event=event.type)


async def message(stream: JobStream, reply: Reply) -> api.MessageOut:
    """The whole message, folded from the events the stream would have sent."""
    out = reply.start().message
    partial = {}  # tool_use input JSON by block index
    async for item in stream:
        for event in reply.on(item):
            if isinstance(event, api.ErrorResponse):
                raise ApiError(item.status, item.message, kind="server_error")
            if isinstance(event, api.ContentBlockStart):
                out.content.append(event.content_block.model_copy())
            elif isinstance(event, api.ContentBlockDelta):
                block, delta = out.content[event.index], event.delta
                if isinstance(delta, api.TextDeltaOut):
                    block.text += delta.text
                elif isinstance(delta, api.ThinkingDeltaOut):
                    block.thinking += delta.thinking
                else:
                    partial[event.index] = partial.get(event.index, "") + delta.partial_json
            elif isinstance(event, api.MessageDelta):
                out.stop_reason, out.stop_sequence = event.delta.stop_reason, event.delta.stop_sequence
                out.usage = event.usage
    for index, text in partial.items():
        out.content[index].input = _input(text)
    return out


def _input(arguments: str) -> Dict[str, Any]:
    """A call's arguments text as tool_use input. A call that max_tokens cut off has no object to give:
    {} (stop_reason max_tokens says why), as the stream's client gets an input it cannot finish either."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
