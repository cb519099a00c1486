"""The OpenAI routes: /v1/models, /v1/chat/completions, /v1/completions. They only translate."""

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ...runtime.served import ServedModel
from ..errors import read_request
from ..streaming import SSE_HEADERS, JobStream
from . import convert
from . import schema as api


def add_routes(app: FastAPI, served: ServedModel, max_body_bytes: int) -> None:
    @app.get("/v1/models")
    def models() -> api.ModelList:
        return api.ModelList(data=[api.ModelCard(id=served.id, created=served.created)])

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await read_request(request, api.ChatCompletionRequest, max_body_bytes)
        # Templating and tokenizing run off the event loop: a long prompt must not stall other streams.
        stream = JobStream(served.worker)
        model_id, job = await asyncio.to_thread(convert.chat_job, served, req, stream.sink)
        stream.submit(job)
        if req.stream:
            events = convert.chat_events(stream, model_id, req.include_usage())
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return await convert.chat_response(stream, model_id)

    @app.post("/v1/completions")
    async def complete(request: Request):
        req = await read_request(request, api.CompletionRequest, max_body_bytes)
        stream = JobStream(served.worker)
        model_id, job = await asyncio.to_thread(convert.completion_job, served, req, stream.sink)
        stream.submit(job)
        if req.stream:
            events = convert.completion_events(stream, model_id, req.include_usage())
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return await convert.completion_response(stream, model_id)
