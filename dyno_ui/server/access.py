"""Who may call the API: the key on /v1/* (401 in the caller's API shape), browser origins (CORS),
and the local server's guards against web pages: the Host a request names, the type of a POST's body."""

import ipaddress
import socket
from typing import Iterable, Optional, Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from ..runtime.errors import ApiError
from ..runtime.keys import key_matches
from .errors import Chooser, retry_headers, under

# Every API route. The playground (/ui) has its own login with the same key. /health, /stats and
# /metrics stay open with a key, as in vLLM: they neither generate nor change state and hold no
# prompt or answer text (only the model's name and counters), and probes and Prometheus scrapers
# read them without being handed the key.
API_PREFIX = "/v1"


def bearer(authorization: Optional[str]) -> Optional[str]:
    """The token of an `Authorization: Bearer TOKEN` header (OpenAI's clients send the key so)."""
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class RequireKey:
    """ASGI middleware: a request under /v1 without the key, as `Authorization: Bearer KEY` or as
    `x-api-key: KEY` (Anthropic's clients), gets a 401 in its API's envelope."""

    def __init__(self, app, key: str, envelope_for: Chooser):
        self.app, self.key, self.envelope_for = app, key, envelope_for

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and under(scope["path"], API_PREFIX):
            headers = Headers(scope=scope)
            given = (headers.get("x-api-key"), bearer(headers.get("authorization")))
            if not any(key_matches(self.key, g) for g in given):
                err = ApiError(401, "Invalid or missing API key: send it as 'Authorization: Bearer KEY' or "
                                    "'x-api-key: KEY'", code="invalid_api_key")
                response = JSONResponse(self.envelope_for(scope["path"], headers)(err), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer", **retry_headers(401)})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(header: str) -> str:
    """The name in a Host header, without its port or brackets, lowercase, without a final dot."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return (header.rsplit(":", 1)[0] if header.count(":") == 1 else header).rstrip(".")


WILDCARDS = ("0.0.0.0", "::", "")


def host_allowed(name: str, bound: str, allowed: Iterable[str]) -> bool:
    """A Host a request may name: the address the server listens on (any of the machine's, and its
    hostname, when it listens on all), loopback addresses, localhost and *.localhost, and the
    `--allowed-hosts` names (`*`: any; `.example.com`: that domain and the names below it)."""
    allowed = [a.lower().rstrip(".") for a in allowed]
    if "*" in allowed or name in allowed or any(a.startswith(".") and (name.endswith(a) or name == a[1:])
                                                  for a in allowed):
        return True
    if name == "localhost" or name.endswith(".localhost") or name == bound.lower():
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:  # a name: DNS rebinding points a page's own name at this address
        return bound in WILDCARDS and name == socket.gethostname().lower()
    return address.is_loopback or bound in WILDCARDS  # an address is no page's name


# What a playground POST may carry: Gradio's JSON calls and its file uploads (its login, with a
# key, posts a form: a page that does not know the key gains nothing by sending one).
UI_BODY_TYPES = ("application/json", "multipart/form-data")
LOGIN_FORM = "application/x-www-form-urlencoded"


def ui_body_allowed(path: str, content_type: str) -> bool:
    """A playground POST's body type is one a web page cannot send without a CORS preflight."""
    kind = content_type.split(";")[0].strip().lower()
    return kind in UI_BODY_TYPES or kind == LOGIN_FORM and path.endswith("/login")


def same_origin(origin: str, host: str) -> bool:
    """True when a browser's Origin header names the site the request was sent to (scheme aside:
    this server speaks plain HTTP, and a proxy in front may add TLS)."""
    return origin.partition("://")[2].rstrip("/").lower() == host.lower()


class LocalGuard:
    """ASGI middleware: a request whose Host names no address of this server (a page whose DNS name
    was rebound to it) gets a 403; a POST outside the API (the playground) whose body is neither JSON
    nor an upload, which a page can send without a CORS preflight, gets a 415, and one (or a websocket)
    from another site's page (its Origin neither this server nor an allowed origin) a 403: a form
    upload needs no preflight either. The API's routes check their bodies' type themselves
    (server/errors.py read_request) and CORS keeps their answers from other sites."""

    def __init__(self, app, bound: str, allowed_hosts: Sequence[str], envelope_for: Chooser,
                 allowed_origins: Sequence[str] = ()):
        self.app, self.bound, self.allowed = app, bound, tuple(allowed_hosts)
        self.origins = tuple(allowed_origins)
        self.envelope_for = envelope_for

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        name, err = host_name(headers.get("host", "")), None
        if not host_allowed(name, self.bound, self.allowed):
            err = ApiError(403, f"Host {name!r} names no address of this server; to serve it, start the "
                                f"server with --allowed-hosts {name or 'NAME'}", kind="permission_error",
                           code="host_not_allowed")
        elif (scope["type"] == "http" and scope["method"] == "POST" and not under(scope["path"], API_PREFIX)
              and not ui_body_allowed(scope["path"], headers.get("content-type", ""))):
            err = ApiError(415, "The request body must be JSON or a file upload", code="unsupported_media_type")
        elif ((scope["type"] == "websocket" or scope["method"] == "POST") and not under(scope["path"], API_PREFIX)
              and (origin := headers.get("origin")) is not None and not same_origin(origin, headers.get("host", ""))
              and "*" not in self.origins and origin not in self.origins):
            err = ApiError(403, f"A page of {origin} cannot drive this server's playground; to let it, start "
                                f"the server with --allowed-origins {origin}", kind="permission_error",
                           code="origin_not_allowed")
        if err is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        response = JSONResponse(self.envelope_for(scope["path"], headers)(err), status_code=err.status,
                                headers=retry_headers(err.status))
        await response(scope, receive, send)


def add_access(app: FastAPI, api_key: Optional[str], allowed_origins: Sequence[str],
               envelope_for: Chooser, bound: str = "127.0.0.1", allowed_hosts: Sequence[str] = ()) -> None:
    """The key check inside CORS: a preflight is answered before any key is asked for, and a 401
    still carries the CORS headers a browser needs to read it. The Host check is outermost: a page
    whose name was rebound to this server gets nothing, not even CORS headers."""
    if api_key:
        app.add_middleware(RequireKey, key=api_key, envelope_for=envelope_for)
    if allowed_origins:
        # Any request header: the origins are the gate, and the SDKs send headers of their own (x-stainless-*).
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    app.add_middleware(LocalGuard, bound=bound, allowed_hosts=allowed_hosts, envelope_for=envelope_for,
                       allowed_origins=allowed_origins)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
