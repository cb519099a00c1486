"""The Anthropic routes: /v1/messages and /v1/messages/count_tokens. They only translate."""

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ...runtime.served import ServedModel
from ..errors import read_request
from ..streaming import SSE_HEADERS, JobStream
from . import convert
from . import schema as api

PREFIX = "/v1/messages"  # errors on these paths use Anthropic's envelope


def add_routes(app: FastAPI, served: ServedModel, max_body_bytes: int, default_thinking: bool = False) -> None:
    """`default_thinking` (--default-thinking): requests without `thinking` keep the template's default."""

    @app.post(PREFIX)
    async def messages(request: Request):
        """Read and check the body, queue its job; stream the events as SSE or fold them into one message."""
        req = await read_request(request, api.MessagesRequest, max_body_bytes)
        stream = JobStream(served.worker)
        # Templating, tokenizing and compiling a tool grammar run off the event loop.
        reply = await asyncio.to_thread(convert.message_job, served, req, stream.sink, default_thinking)
        stream.submit(reply.job)
        if req.stream:
            return StreamingResponse(convert.events(stream, reply), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await convert.message(stream, reply)

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens(request: Request) -> api.CountTokensResponse:
        req = await read_request(request, api.CountTokensRequest, max_body_bytes)
        tokens = await asyncio.to_thread(convert.count_tokens, served, req, default_thinking)
        return api.CountTokensResponse(input_tokens=tokens)
