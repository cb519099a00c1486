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
Body = TypeVar("Body", bound=BaseModel)
Envelope = Callable[[ApiError], dict]


async def read_request(request: Request, kind: Type[Body], max_bytes: int) -> Body:
    """The JSON body as `kind`: 415 unless it is sent as JSON, 413 past max_bytes; the fields `kind`
    does not know are logged and counted (server/fields.py) when the app keeps `ignored_fields`."""
    if not is_json(request.headers.get("content-type")):
        # A web page may POST text/plain or a form to any address without a CORS preflight: a JSON
        # type is what keeps other sites' pages from starting generations on this machine.
        raise ApiError(415, "The request body must be sent as Content-Type: application/json, got "
                            f"{request.headers.get('content-type') or 'none'}", code="unsupported_media_type")
    length = request.headers.get("content-length", "")
    body = bytearray()
    too_large = length.isdigit() and int(length) > max_bytes
    if not too_large:
        async for chunk in request.stream():  # bounded even when the body is chunked
            body += chunk
            if len(body) > max_bytes:
                too_large = True
                break
    if too_large:
        await drain(request, max_bytes)
        raise ApiError(413, f"The request body is larger than {max_bytes} bytes", code="request_too_large")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"The request body is not valid JSON: {e}") from None
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    ignored = getattr(request.app.state, "ignored_fields", None)
    if ignored is not None:
        ignored.note(request.url.path, req)
    return req


def is_json(content_type: Optional[str]) -> bool:
    """True for application/json (any parameters) and the application/*+json types."""
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or kind.startswith("application/") and kind.endswith("+json")


DRAIN_LIMIT = 1 << 30  # past this much the connection is dropped instead: reading it all costs more


async def drain(request: Request, max_bytes: int) -> None:
    """Read and drop the rest of a body too large to keep, so the client, still sending, reads the 413
    instead of a reset connection (a server that answers early and closes makes the client's next
    write fail before it reads the answer). Nothing is kept: the memory stays bounded."""
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > DRAIN_LIMIT + max_bytes:
                return
    except Exception:  # the body was partly consumed or the client left: nothing more to read
        return


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
NO_RETRY = (400, 401, 403, 404, 405, 413, 415, 422)
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
