"""The error a request gets: a status, a one-line message, and the field it names. Each API renders
it in its own envelope; nothing here knows HTTP."""

from typing import Optional


class ApiError(Exception):
    """An error the client sees with `status`; `kind` and `code` follow OpenAI's names."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
