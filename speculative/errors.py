"""The one exception type users see."""


class DynoError(Exception):
    """A user-facing failure: a one-line message and the exit code the CLI returns."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
