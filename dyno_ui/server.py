"""The FastAPI app: OpenAI routes, /health, /stats, /metrics, and OpenAI-shaped errors.

`create_app` is reusable: the playground mounts itself on the same app (at /ui). Routes only
translate; requests become engine jobs in completions.py, and the engine runs on the worker.
"""

import asyncio
import json
import logging
from typing import Type, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from speculative.errors import DynoError

from . import completions
from . import openai_schema as api
from .completions import JobStream, ServedModel

log = logging.getLogger("dyno.serve")
MAX_BODY_BYTES = 32 * 1024 * 1024
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
Body = TypeVar("Body", bound=api.SamplingFields)


def create_app(served: ServedModel, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's app for `served`, whose worker is already started."""
    app = FastAPI(title="Dyno", version="0.1.0")
    app.state.served = served
    _add_error_handlers(app)
    metrics = served.worker.metrics

    @app.get("/health")
    def health():
        ok = served.worker.alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": served.id},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    def models() -> api.ModelList:
        return api.ModelList(data=[api.ModelCard(id=served.id, created=served.created)])

    @app.get("/stats")
    def stats():
        memory = served.lm.head_memory  # the model served now (the Models tab can swap it)
        return {**metrics.stats_json(), "mtp_head": memory.as_json() if memory else None}

    @app.get("/metrics")
    def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await read_request(request, api.ChatCompletionRequest, max_body_bytes)
        # Templating and tokenizing run off the event loop: a long prompt must not stall other streams.
        stream = JobStream(served.worker)
        model_id, job = await asyncio.to_thread(served.chat_job, req, stream.sink)
        stream.submit(job)
        if req.stream:
            events = completions.chat_events(stream, model_id, req.include_usage())
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return await completions.chat_response(stream, model_id)

    @app.post("/v1/completions")
    async def complete(request: Request):
        req = await read_request(request, api.CompletionRequest, max_body_bytes)
        stream = JobStream(served.worker)
        model_id, job = await asyncio.to_thread(served.completion_job, req, stream.sink)
        stream.submit(job)
        if req.stream:
            events = completions.completion_events(stream, model_id, req.include_usage())
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return await completions.completion_response(stream, model_id)

    return app


async def read_request(request: Request, kind: Type[Body], max_bytes: int) -> Body:
    """The JSON body as `kind`, whatever the Content-Type (curl -d sends a form type); 413 past max_bytes."""
    too_large = api.ApiError(413, f"The request body is larger than {max_bytes} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():  # bounded even when the body is chunked
        body += chunk
        if len(body) > max_bytes:
            raise too_large
    try:
        data = json.loads(body)
    except ValueError as e:
        raise api.ApiError(400, f"The request body is not valid JSON: {e}") from None
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


def _error(err: api.ApiError) -> JSONResponse:
    return JSONResponse(api.error_response(err).model_dump(), status_code=err.status)


def _validation_error(errors) -> api.ApiError:
    """The first validation error as one OpenAI-style line, naming the offending field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if not loc and first.get("type") == "model_type":
        return api.ApiError(400, "The request body must be a JSON object")
    return api.ApiError(400, f"{param}: {first['msg']}" if param else str(first["msg"]), param=param)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as {"error": {...}} with its status; never a traceback."""

    @app.exception_handler(api.ApiError)
    async def api_error(_: Request, exc: api.ApiError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        return _error(_validation_error(exc.errors()))

    @app.exception_handler(DynoError)
    async def dyno_error(_: Request, exc: DynoError):
        return _error(api.ApiError(400, exc.message))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(api.ApiError(exc.status_code, str(exc.detail), kind=kind))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return _error(api.ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

