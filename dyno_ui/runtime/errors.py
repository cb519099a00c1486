"""The error a request gets: a status, a one-line message, and the field it names. Each API renders
it in its own envelope; nothing here knows HTTP."""

from contextlib import contextmanager
from typing import Optional

from speculative.errors import DynoError, one_line

# Errors the tool checks raise name their own field in their first words ("invalid tools: ...").
_NAMED_BY_MESSAGE = {"invalid tools": "tools", "invalid tool_choice": "tool_choice"}


class ApiError(Exception):
    """An error the client sees with `status`; `kind` and `code` follow OpenAI's names."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error",
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after  # seconds, sent as the Retry-After header


STOPPED = "the server is shutting down"
RETRY_AFTER_S = 1  # a queue slot frees as soon as any request finishes or starts


def queue_full(limit: int) -> ApiError:
    """The 503 a request gets when `limit` requests already wait for the engine."""
    return ApiError(503, f"the server is busy: {limit} requests are already waiting; retry shortly",
                    code="queue_full", kind="server_error", retry_after=RETRY_AFTER_S)


def failure(error: BaseException) -> str:
    """The one line a client gets for an exception raised while serving its request."""
    return f"generation failed: {one_line(error)}"


@contextmanager
def bad_request(param: str):
    """A DynoError inside (a bad tool, schema or choice) is the request's fault: a 400 naming `param`,
    or the field the message names first."""
    try:
        yield
    except DynoError as e:
        named = next((v for k, v in _NAMED_BY_MESSAGE.items() if e.message.startswith(k + ":")), param)
        raise ApiError(400, e.message, param=named) from None
