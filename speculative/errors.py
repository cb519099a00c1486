"""The one exception type users see."""


class DynoError(Exception):
    """A user-facing failure: a one-line message and the exit code the CLI returns."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def one_line(error: BaseException) -> str:
    """An exception as one line for a user: its message's first line, else its type's name."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
