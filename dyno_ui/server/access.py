"""Who may call the API: the key on /v1/* (401 in the caller's API shape) and browser origins (CORS)."""

import ipaddress
from typing import Optional, Sequence

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


def add_access(app: FastAPI, api_key: Optional[str], allowed_origins: Sequence[str],
               envelope_for: Chooser) -> None:
    """The key check inside CORS: a preflight is answered before any key is asked for, and a 401
    still carries the CORS headers a browser needs to read it."""
    if api_key:
        app.add_middleware(RequireKey, key=api_key, envelope_for=envelope_for)
    if allowed_origins:
        # Any request header: the origins are the gate, and the SDKs send headers of their own (x-stainless-*).
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
