"""Reading a request body, and turning every error into its API's envelope: never a traceback."""

import json
import logging
from typing import Callable, Mapping, Optional, Tuple, Type, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from speculative.errors import DynoError

from ..runtime.errors import RETRY_AFTER_S, ApiError

log = logging.getLogger("dyno.serve")
MAX_BODY_BYTES = 32 * 1024 * 1024
Body = TypeVar("Body", bound=BaseModel)
Envelope = Callable[[ApiError], dict]


async def read_request(request: Request, kind: Type[Body], max_bytes: int) -> Body:
    """The JSON body as `kind`, whatever the Content-Type (curl -d sends a form type); 413 past max_bytes."""
    too_large = ApiError(413, f"The request body is larger than {max_bytes} bytes", code="request_too_large")
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
        raise ApiError(400, f"The request body is not valid JSON: {e}") from None
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors) -> ApiError:
    """The first validation error as one line, naming the offending field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if not loc and first.get("type") == "model_type":
        return ApiError(400, "The request body must be a JSON object")
    if first.get("type") == "extra_forbidden":  # types that refuse fields they do not know
        return ApiError(400, f"{param}: unknown parameter", param=param, code="unknown_parameter")
    return ApiError(400, f"{param}: {first['msg']}" if param else str(first["msg"]), param=param)


Chooser = Callable[[str, Mapping[str, str]], Envelope]

# Anthropic's API marks the answers a client must not retry, and those it should retry after a
# while; both APIs' SDKs read x-should-retry before their own status rules, and Retry-After.
NO_RETRY = (400, 401, 403, 404, 405, 413, 422)
RETRY_LATER = (429, 503, 529)


def retry_headers(status: int, retry_after: Optional[int] = None) -> dict:
    """x-should-retry (and Retry-After, in seconds) for an error with `status`; none for other statuses."""
    if status in NO_RETRY:
        return {"x-should-retry": "false"}
    if status in RETRY_LATER:
        return {"retry-after": str(RETRY_AFTER_S if retry_after is None else retry_after), "x-should-retry": "true"}
    return {}


def under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or a path below it."""
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def envelope_chooser(default: Envelope, by_path: Optional[Mapping[str, Envelope]] = None,
                     by_header: Optional[Mapping[str, Tuple[str, Envelope]]] = None) -> Chooser:
    """The envelope for a request's path and headers: the one registered for the path (or a path under
    it); on a path `by_header` names, its envelope when the request carries its header; else `default`."""
    prefixes = sorted((by_path or {}).items(), key=lambda kv: -len(kv[0]))  # the most specific first

    def choose(path: str, headers: Mapping[str, str]) -> Envelope:
        for prefix, envelope in prefixes:
            if under(path, prefix):
                return envelope
        for prefix, (header, envelope) in (by_header or {}).items():
            if under(path, prefix) and header in headers:
                return envelope
        return default

    return choose


def add_error_handlers(app: FastAPI, envelope: Envelope, by_path: Optional[Mapping[str, Envelope]] = None,
                       by_header: Optional[Mapping[str, Tuple[str, Envelope]]] = None) -> Chooser:
    """Every error leaves as its API's envelope with its status: `by_path`'s for paths under one of its
    prefixes (the Anthropic routes), `by_header`'s on a path both APIs share for a request with that
    header (an Anthropic client), `envelope` for the rest. Returns the chooser (the key check uses it)."""
    choose = envelope_chooser(envelope, by_path, by_header)

    def respond(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(choose(request.url.path, request.headers)(err), status_code=err.status,
                            headers=retry_headers(err.status, err.retry_after))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return respond(request, validation_error(exc.errors()))

    @app.exception_handler(DynoError)
    async def dyno_error(request: Request, exc: DynoError):
        return respond(request, ApiError(400, exc.message))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, ApiError(exc.status_code, str(exc.detail), kind=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return respond(request, ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

    return choose
