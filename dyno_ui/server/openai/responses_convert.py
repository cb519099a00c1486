"""From Responses API requests to engine jobs, and from job outputs to the Response object and its
stream events.

The request becomes the same neutral ChatRequest chat completions build, and the same job
(runtime/chat.py). The answer is a list of output items, opened and closed as the outputs arrive:
reasoning (the <think> text), message (the answer's text) and one function_call per tool call. The
non-streamed Response is the one the stream's last event carries, so the two hold the same output.
"""

import logging
from typing import AsyncIterator, List, Optional, Tuple

from ...runtime import chat
from ...runtime.errors import ApiError
from ...runtime.outputs import Failed, Finished, TextDelta, TokenLogprob, ToolCallDelta
from ...runtime.served import ServedModel
from ...runtime.worker import Job
from ..streaming import JobStream, sse
from . import responses_schema as api

log = logging.getLogger("dyno.serve")

# The chat runtime names the fields at fault as chat completions spell them.
PARAMS = {"messages": "input", "response_format": "text.format"}


def responses_job(served: ServedModel, req: api.ResponsesRequest, sink) -> Tuple[str, Job]:
    """(model id, job) for a Responses request, made exactly as a chat completion's."""
    request = req.chat_request()
    hosted = req.hosted()
    if hosted:
        log.info("dyno: /v1/responses: left out hosted tools this server cannot run: %s", ", ".join(hosted))
    try:
        return chat.job_for(served, request, sink)
    except ApiError as e:
        if e.param in PARAMS:
            e.param = PARAMS[e.param]
            e.message = e.message.replace("messages", "input", 1) if e.message.startswith("messages") else e.message
        raise


def echoed(req: api.ResponsesRequest, model: str) -> api.Response:
    """A fresh in-progress Response with the request's settings, as OpenAI echoes them."""
    fmt = api.declared(req.text.format, by_alias=True, exclude_none=True) if req.text and req.text.format else None
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    tools = [api.declared(t) for t in req.functions()]
    for tool in tools:
        tool["strict"] = tool["strict"] is not False
    reasoning = api.declared(req.reasoning, exclude_none=True) if req.reasoning else {}
    return api.Response(
        id=api.new_id("resp"), created_at=api.now(), model=model, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls is not False, reasoning={"effort": None, "summary": None, **reasoning},
        store=False, temperature=req.temperature, text={"format": fmt or {"type": "text"}},
        tool_choice=choice, tools=tools, top_p=req.top_p, user=req.user)


class Reply:
    """One request's job outputs as Responses stream events, building the Response as it goes."""

    def __init__(self, req: api.ResponsesRequest, model: str, job: Job):
        self.job = job
        self.response = echoed(req, model)
        self.sequence = 0
        self.open: Optional[api.OutputItem] = None  # the item being written
        self.call_items = {}  # the answer's tool call index -> its item
        self.namespaces = req.namespaces()  # a flat tool name -> (namespace, name), to name calls back

    def start(self) -> List[api.Event]:
        return [self._response("response.created"), self._response("response.in_progress")]

    def on(self, item) -> List[api.Event]:
        """The events one job output makes."""
        if isinstance(item, TokenLogprob) or isinstance(item, TextDelta) and not item.text:
            return []
        if isinstance(item, TextDelta):
            return self._write(item)
        if isinstance(item, ToolCallDelta):
            return self._call(item)
        if isinstance(item, Failed):
            return self._fail(item)
        return self._finish(item)

    def _write(self, item: TextDelta) -> List[api.Event]:
        kind = api.ReasoningOut if item.channel == "reasoning" else api.MessageOut
        events = [] if isinstance(self.open, kind) else self._close() + self._add(kind(id=api.new_id(
            "rs" if kind is api.ReasoningOut else "msg")))
        where = dict(item_id=self.open.id, output_index=len(self.response.output) - 1)
        self.open.content[0].text += item.text
        if kind is api.ReasoningOut:
            return events + [self._event(api.ReasoningDeltaEvent, "response.reasoning_text.delta", delta=item.text,
                                         **where)]
        return events + [self._event(api.TextDeltaEvent, "response.output_text.delta", delta=item.text, **where)]

    def _call(self, item: ToolCallDelta) -> List[api.Event]:
        events = []
        if item.index not in self.call_items:  # its first piece: the id and name
            space, name = self.namespaces.get(item.name or "", (None, item.name or ""))
            events = self._close() + self._add(api.FunctionCallOut(id=api.new_id("fc"), call_id=item.id,
                                                                   name=name, namespace=space))
            self.call_items[item.index] = self.open
        if item.arguments:
            call = self.call_items[item.index]
            call.arguments += item.arguments
            events.append(self._event(api.ArgumentsDeltaEvent, "response.function_call_arguments.delta",
                                      item_id=call.id, output_index=self._index(call), delta=item.arguments))
        return events

    def _add(self, item: api.OutputItem) -> List[api.Event]:
        """output_item.added, and for text its one content part."""
        self.response.output.append(item)
        self.open = item
        index = len(self.response.output) - 1
        events = [self._event(api.ItemEvent, "response.output_item.added", output_index=index,
                              item=item.model_copy(deep=True))]
        part = {api.MessageOut: api.OutputText, api.ReasoningOut: api.ReasoningText}.get(type(item))
        if part is not None:
            events.append(self._event(api.PartEvent, "response.content_part.added", item_id=item.id,
                                      output_index=index, part=part()))
            item.content = [part()]
        return events

    def _close(self, status: str = "completed") -> List[api.Event]:
        """The open item's done events, with `status` (incomplete: the answer was cut inside it)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self._index(item)
        where = dict(item_id=item.id, output_index=index)
        events = []
        if isinstance(item, api.FunctionCallOut):  # calls arrive whole, once their block has closed
            events.append(self._event(api.ArgumentsDoneEvent, "response.function_call_arguments.done",
                                      name=item.name, arguments=item.arguments, **where))
        else:
            part = item.content[0]
            done = (api.TextDoneEvent, "response.output_text.done") if isinstance(item, api.MessageOut) \
                else (api.ReasoningDoneEvent, "response.reasoning_text.done")
            events += [self._event(done[0], done[1], text=part.text, **where),
                       self._event(api.PartEvent, "response.content_part.done", part=part.model_copy(), **where)]
        item.status = status
        return events + [self._event(api.ItemEvent, "response.output_item.done", output_index=index,
                                     item=item.model_copy(deep=True))]

    def _finish(self, done: Finished) -> List[api.Event]:
        length = done.finish_reason == "length"
        status = "incomplete" if length else "completed"
        events = self._close(status)
        if not self.response.output:  # an empty answer (or a call cut before its name) is still a message
            events += self._add(api.MessageOut(id=api.new_id("msg"))) + self._close(status)
        r = self.response
        r.usage = api.Usage(input_tokens=done.prompt_tokens,
                            input_tokens_details=api.InputTokensDetails(cached_tokens=done.cached_tokens),
                            output_tokens=done.completion_tokens,
                            output_tokens_details=api.OutputTokensDetails(reasoning_tokens=self.job.text.reasoning_tokens),
                            total_tokens=done.prompt_tokens + done.completion_tokens)
        r.drafting = done.drafting
        if length:
            r.status, r.incomplete_details = "incomplete", api.IncompleteDetails(reason="max_output_tokens")
            return events + [self._response("response.incomplete")]
        r.status, r.completed_at = ("cancelled", None) if done.finish_reason == "cancelled" else ("completed", api.now())
        return events + [self._response("response.completed")]

    def _fail(self, failed: Failed) -> List[api.Event]:
        self.response.status = "failed"
        self.response.error = api.ResponseError(code="server_error", message=failed.message)
        return [self._event(api.ErrorEvent, "error", code="server_error", message=failed.message),
                self._response("response.failed")]

    def _index(self, item: api.OutputItem) -> int:
        return next(i for i, x in enumerate(self.response.output) if x is item)

    def _response(self, kind: str) -> api.Event:
        return self._event(api.ResponseEvent, kind, response=self.response.model_copy(deep=True))

    def _event(self, cls, kind: str, **fields) -> api.Event:
        event = cls(type=kind, sequence_number=self.sequence, **fields)
        self.sequence += 1
        return event


async def response_events(stream: JobStream, reply: Reply) -> AsyncIterator[str]:
    """The SSE stream: response.created and .in_progress, the items' events, then response.completed
    (.incomplete when cut by max_output_tokens; error and response.failed when the engine failed)."""
    for event in reply.start():
        yield sse(event, event=event.type)
    async for item in stream:
        for event in reply.on(item):
            yield sse(event, event=event.type)


async def whole_response(stream: JobStream, reply: Reply) -> api.Response:
    """The Response the stream's last event would carry."""
    reply.start()
    async for item in stream:
        if isinstance(item, Failed):
            raise ApiError(item.status, item.message, kind="server_error")
        reply.on(item)
    return reply.response

