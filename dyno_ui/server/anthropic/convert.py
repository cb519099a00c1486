"""From Anthropic requests to engine jobs, and from job outputs to Anthropic messages and stream events.

A request becomes the runtime's ChatRequest (runtime/request.py), which runtime/chat.py turns into
a job as it does OpenAI's: `system` first, system messages inside `messages` where they stand (placed
as the template allows: runtime/system_turns.py), assistant `tool_use` blocks as the template's tool calls,
`tool_result` blocks as tool messages, thinking blocks as the assistant's reasoning; tool_choice any
or a named tool is a forced call and output_config.format a schema, each a grammar. What is
Anthropic's alone is checked here: the prefill (a final assistant message) and what it cannot be
combined with, and thinking as asked: `thinking` is the template's switch, `budget_tokens` or
`output_config.effort` the thinking budget. The non-streaming message is a fold of the same events
the stream sends.
"""

import json
import logging
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from ...runtime import chat
from ...runtime.errors import ApiError
from ...runtime.outputs import Failed, Finished, TextDelta, ToolCallDelta
from ...runtime.request import EFFORT_BUDGETS as OPENAI_EFFORTS
from ...runtime.request import (IMAGE_PLACEHOLDER, ChatRequest, JsonSchema, Message, Sampling, Tool, ToolCall,
                                ToolChoice)
from ...runtime.served import ServedModel
from ...runtime.worker import Job
from ..streaming import JobStream, sse
from . import schema as api

log = logging.getLogger("dyno.serve")

# ---- requests ------------------------------------------------------------------------------

# Thinking tokens for Anthropic's output_config.effort, as for OpenAI's reasoning efforts of the same
# names; None: the server's budget (--reasoning-budget, unlimited by default).
EFFORT_BUDGETS = {"low": OPENAI_EFFORTS["low"], "medium": OPENAI_EFFORTS["medium"], "high": OPENAI_EFFORTS["high"],
                  "xhigh": None, "max": None}


def chat_request(req: api.Conversation, default_thinking: bool = False) -> ChatRequest:
    """The request in the runtime's terms, after the checks only Anthropic's API makes;
    `default_thinking` (--default-thinking): no `thinking` field keeps the template's default."""
    prefill = prefill_text(req)
    # A final assistant message is the answer's start, not a turn (empty: the answer starts afresh).
    messages = req.messages[:-1] if req.messages[-1].role == "assistant" else req.messages
    if not messages:
        raise ApiError(400, "messages: a final assistant message (prefill) needs a user message before it",
                       param="messages")
    forced = req.tool_choice is not None and req.tool_choice.forced
    if req.server_tools:
        named = req.tool_choice.name if forced and req.tool_choice.type == "tool" else None
        if named in req.server_tools or (forced and not req.tools):
            raise ApiError(400, f"tool_choice: {named or req.tool_choice.type!r} forces a call of a server tool "
                                f"({', '.join(req.server_tools)}), which runs on Anthropic's side: this server "
                                f"cannot run it (offer a custom tool instead)", param="tool_choice")
        log.info("dyno: /v1/messages: left out server tools this server cannot run: %s", ", ".join(req.server_tools))
    if forced and not req.tools:
        raise ApiError(400, f"tool_choice: {req.tool_choice.type!r} requires a tool call but no tools were given",
                       param="tool_choice")
    if prefill and (forced or req.output_schema is not None):
        raise ApiError(400, "messages: a final assistant message (prefill) cannot be combined with a forced "
                            "tool_choice or output_config.format, whose grammar starts the answer", param="messages")
    if prefill and req.thinking is not None and req.thinking.type == "enabled":
        raise ApiError(400, "messages: a final assistant message (prefill) cannot be combined with thinking "
                            "enabled, as in Anthropic's API: a prefill starts the text answer", param="messages")
    thinking = None  # adaptive: the template's default
    if req.thinking is not None and req.thinking.type != "adaptive":
        thinking = req.thinking.type == "enabled"
    if req.thinking is None and not default_thinking:  # not given: no thinking, as in Anthropic's API
        thinking = False
    budget = None  # the server's, if it sets one
    if thinking is not False:  # enabled or adaptive: budget_tokens, else the effort's
        given = req.thinking.budget_tokens if req.thinking is not None else None
        budget = given if given is not None else EFFORT_BUDGETS.get(effort(req))
    if prefill:  # the prefill is the text answer's start: the template closes its think block first
        thinking = False
    choice, parallel = tool_choice(req.tool_choice)
    sampling, stop, draft, copies = Sampling(), (), None, None
    if isinstance(req, api.MessagesRequest):  # count_tokens has no sampling fields
        sampling = Sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
        stop, draft, copies = tuple(req.stop_strings()), req.draft, req.copies
    return ChatRequest(
        messages=tuple(conversation(req, messages)), model=req.model, tools=tuple(tools(req.tools)),
        tool_choice=choice, parallel_tool_calls=parallel,
        response_format=None if req.output_schema is None else JsonSchema(req.output_schema),
        thinking=thinking, thinking_budget=budget, prefill=prefill, sampling=sampling, stop=stop,
        draft=draft, copies=copies)


def effort(req: api.Conversation) -> Optional[str]:
    """The effort of the turn being answered: a system message's own after the last user message,
    else the request's output_config.effort."""
    for message in reversed(req.messages):
        if message.role == "user":
            break
        if message.role == "system" and message.output_config and message.output_config.effort:
            return message.output_config.effort
    return req.output_config.effort if req.output_config else None


def conversation(req: api.Conversation, messages: List[api.Message]) -> List[Message]:
    """`system`, then `messages`: a run of text blocks is one user turn (blocks a paragraph apart),
    a tool result a tool message, a system message a system turn where it stands (one with
    clear_at next_user_message only until a user message follows it)."""
    out = [Message("system", req.system_text())] if req.system is not None else []
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    for i, message in enumerate(messages):
        if message.role == "system":
            if message.clear_at != "next_user_message" or i > last_user:
                out.append(Message("system", message.text()))
            continue
        if message.role == "assistant":
            out.append(_assistant(message.blocks()))
            continue
        text: List[str] = []
        images: List[str] = []
        for block in message.blocks():  # tool results, text and images, in their order
            if isinstance(block, api.ToolResultBlock):
                if text:
                    out.append(Message("user", "\n\n".join(text), images=tuple(images)))
                    text, images = [], []
                out.append(Message("tool", block.text(), tool_call_id=block.tool_use_id))
            elif isinstance(block, api.ImageBlock):
                text.append(IMAGE_PLACEHOLDER)
                images.append(block.source.as_url())
            else:
                text.append(block.text)
        if text:
            out.append(Message("user", "\n\n".join(text), images=tuple(images)))
    return out


def _assistant(blocks) -> Message:
    text = "".join(b.text for b in blocks if isinstance(b, api.TextBlock))
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, api.ThinkingBlock))
    calls = tuple(ToolCall(b.name, b.input, b.id) for b in blocks if isinstance(b, api.ToolUseBlock))
    return Message("assistant", text, reasoning=reasoning or None, tool_calls=calls)


def tools(given: Optional[List[api.Tool]]) -> List[Tool]:
    """The tools, their descriptions "" when not given."""
    return [Tool(t.name, t.description or "", t.input_schema) for t in given or ()]


def tool_choice(choice: Optional[api.ToolChoice]) -> Tuple[ToolChoice, bool]:
    """(the tool choice resolved, whether the answer may make more than one call)."""
    if choice is None:
        return ToolChoice(), True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return ToolChoice.named(choice.name), parallel
    return ToolChoice("required" if choice.type == "any" else choice.type), parallel


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


def count_tokens(served: ServedModel, req: api.CountTokensRequest, default_thinking: bool = False) -> int:
    """Tokens of the prompt /v1/messages would build for the same conversation."""
    return len(chat.prompt_for(served, chat_request(req, default_thinking)).tokens)


def message_job(served: ServedModel, req: api.MessagesRequest, sink, default_thinking: bool = False) -> "Reply":
    """The job for a request, with the Reply that turns its outputs into events. A forced tool call
    (any, or a named tool) and output_config.format are grammars (after the reasoning the template
    opened, if any): drafting stays on and the answer is valid against the schema."""
    _, job = chat.job_for(served, chat_request(req, default_thinking), sink)
    return Reply(req.model, job)  # the id the request named (one of the served ids)


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
        return self._close() + [api.MessageDelta(delta=self._stop(item), usage=usage(item), drafting=item.drafting),
                                api.MessageStop()]

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
                out.usage, out.drafting = event.usage, event.drafting
    for index, text in partial.items():
        out.content[index].input = _input(text)
    return out


def _input(arguments: str) -> Dict[str, Any]:
    """A call's arguments text as tool_use input. The runtime sends only calls whose block closed and
    parsed (a call cut by max_tokens is dropped); arguments that are not an object give {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
