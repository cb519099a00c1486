"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/responses (/v1/models: server/models.py).
They only translate."""

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ...runtime.served import ServedModel
from ..errors import read_request
from ..streaming import SSE_HEADERS, JobStream
from . import convert, responses_convert
from . import responses_schema
from . import schema as api


def add_routes(app: FastAPI, served: ServedModel, max_body_bytes: int) -> None:
    async def answer(request: Request, kind, make_job, events, response):
        """Read and check the body, queue its job; stream the outputs as SSE or fold them into one response."""
        req = await read_request(request, kind, max_body_bytes)
        # Templating and tokenizing run off the event loop: a long prompt must not stall other streams.
        stream = JobStream(served.worker)
        model_id, job = await asyncio.to_thread(make_job, served, req, stream.sink)
        stream.submit(job)
        if req.stream:
            return StreamingResponse(events(stream, model_id, req.include_usage()), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await response(stream, model_id)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, api.ChatCompletionRequest, convert.chat_job, convert.chat_events,
                            convert.chat_response)

    @app.post("/v1/completions")
    async def complete(request: Request):
        return await answer(request, api.CompletionRequest, convert.completion_job, convert.completion_events,
                            convert.completion_response)

    @app.post("/v1/responses")
    async def respond(request: Request):
        req = await read_request(request, responses_schema.ResponsesRequest, max_body_bytes)
        stream = JobStream(served.worker)
        model_id, job = await asyncio.to_thread(responses_convert.responses_job, served, req, stream.sink)
        reply = responses_convert.Reply(req, model_id, job)
        stream.submit(job)
        if req.stream:
            return StreamingResponse(responses_convert.response_events(stream, reply), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await responses_convert.whole_response(stream, reply)
