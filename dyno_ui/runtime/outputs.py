"""What a job sends to its handler: text and tool calls, then Finished or Failed (and, when traced,
engine events).

Plain data with no MLX: the playground's rendering and the APIs' folding import these alone.
"""

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union


@dataclass(frozen=True)
class TextDelta:
    """New text for one channel: "content" or "reasoning"."""

    channel: str
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the `index`-th tool call of the answer (runtime/parsers): its first piece carries
    the call's `id` and function `name`, every piece some of its JSON `arguments` text, which the
    pieces of one call concatenate to."""

    index: int
    arguments: str
    id: Optional[str] = None
    name: Optional[str] = None


@dataclass(frozen=True)
class TokenLogprob:
    """One delivered token's log-probability (runtime/logprobs.py), sent before that token's text,
    with its `top` alternatives (each a TokenLogprob without alternatives) when asked for.

    `token` is the token's own bytes decoded (UTF-8, invalid bytes replaced: a token that holds part
    of a character says so by its `bytes`), so the tokens' strings need not line up with the text
    deltas, which hold back partial characters and stop strings.
    """

    token: str
    bytes: Tuple[int, ...]
    logprob: float
    top: Tuple["TokenLogprob", ...] = ()


@dataclass(frozen=True)
class Finished:
    """The last output of a job that ran to its end (stop or length) or was cancelled."""

    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    drafting: Optional[Dict[str, Any]] = None  # what drafting did for it (runtime/figures.py)


@dataclass(frozen=True)
class Failed:
    """The last output of a job the engine could not complete; `status` is the HTTP status it maps to."""

    message: str
    status: int = 500


@dataclass(frozen=True)
class Traced:
    """An engine event (Token, Round or Done) and when it arrived; sent only to jobs with trace=True."""

    event: object
    at: float  # time.perf_counter()


Output = Union[TextDelta, ToolCallDelta, TokenLogprob, Finished, Failed]
