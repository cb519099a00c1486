"""The error a request gets: a status, a one-line message, and the field it names. Each API renders
it in its own envelope; nothing here knows HTTP."""

from contextlib import contextmanager
from typing import Optional

from speculative.errors import DynoError

# Errors the tool checks raise name their own field in their first words ("invalid tools: ...").
_NAMED_BY_MESSAGE = {"invalid tools": "tools", "invalid tool_choice": "tool_choice"}


class ApiError(Exception):
    """An error the client sees with `status`; `kind` and `code` follow OpenAI's names."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


@contextmanager
def bad_request(param: str):
    """A DynoError inside (a bad tool, schema or choice) is the request's fault: a 400 naming `param`,
    or the field the message names first."""
    try:
        yield
    except DynoError as e:
        named = next((v for k, v in _NAMED_BY_MESSAGE.items() if e.message.startswith(k + ":")), param)
        raise ApiError(400, e.message, param=named) from None
