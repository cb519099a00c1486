"""The server's API key, compared one way wherever it is asked for (the HTTP routes, the playground)."""

import hmac
from typing import Optional


def key_matches(expected: str, given: Optional[str]) -> bool:
    """True when `given` is the key (compared in constant time)."""
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())
