"""One generation as the playground sees it: a traced job's outputs, pure (no MLX).

The engine's events are folded by GenerationStats, the fold the CLI line, /stats and /metrics
use; Trace adds only what the playground shows beside it: when each token and round arrived,
and the text each token produced. The worker sends each engine event as `Traced` just before
the text that event's token produced, so every piece of text is attributed to the provenance of
the token that made it.
"""

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

from speculative.events import Done, Round, RoundDetails, Token
from speculative.stats import GenerationStats

from ..runtime.outputs import Failed, Finished, TextDelta, Traced


@dataclass(frozen=True)
class Span:
    """Text one token produced, in one channel ("content" or "reasoning")."""

    text: str
    kind: str  # a Provenance value: "draft", "copy", "correction", "bonus" or "plain"
    channel: str
    at: float  # when its token arrived (perf_counter seconds)
    token: int = -1  # index of that token in Trace.tokens


@dataclass(frozen=True)
class TokenPoint:
    """One emitted token: its id, provenance, round (1-based; 0 outside any round) and position in it."""

    id: int
    kind: str
    round: int
    position: int  # 0-based: drafts 0..accepted-1, then the correction or bonus
    logprob: Optional[float] = None


@dataclass(frozen=True)
class RoundPoint:
    """One draft/verify round: drafts kept of drafted, and the tokens per second it committed at."""

    drafted: int
    accepted: int
    seconds: float  # since the previous round (or the first token)
    drafts: Tuple[int, ...] = ()  # the drafted ids, as verified
    details: Optional[RoundDetails] = None  # p, q, acceptance chance per draft (the details switch)
    first: int = 0  # index in Trace.tokens of the round's first token
    delivered: int = 0  # of its tokens, how many the consumer received
    closer: Optional[str] = None  # "correction" or "bonus" once that token arrived
    source: str = "head"  # where its drafts came from: "head" (the MTP head) or "copy" (the context)

    @property
    def rejected(self) -> Tuple[int, ...]:
        """Drafts refused after a delivered correction: the first failed verification, the rest never counted."""
        return self.drafts[self.accepted:] if self.closer == "correction" else ()

    @property
    def tokens(self) -> int:
        return self.accepted + 1  # the accepted drafts plus the correction or bonus token

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Trace:
    """Running state of one traced generation: its GenerationStats plus timing and text; `add` each
    job output as it arrives."""

    submitted_at: float
    stats: GenerationStats = field(default_factory=GenerationStats)
    spans: List[Span] = field(default_factory=list)
    token_times: List[float] = field(default_factory=list)
    rounds: List[RoundPoint] = field(default_factory=list)
    tokens: List[TokenPoint] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    decode: Optional[Callable[[List[int]], str]] = field(default=None, repr=False, compare=False)
    _kind: str = "plain"
    _last_round_at: Optional[float] = None
    _pieces: Dict[int, str] = field(default_factory=dict, repr=False)

    def add(self, item) -> None:
        if isinstance(item, Traced):
            self._event(item.event, item.at)
        elif isinstance(item, TextDelta) and item.text:
            at = self.token_times[-1] if self.token_times else self.submitted_at
            self.spans.append(Span(item.text, self._kind, item.channel, at, len(self.tokens) - 1))
        elif isinstance(item, Finished):
            self.finish_reason = item.finish_reason
        elif isinstance(item, Failed):
            self.error = item.message

    def _event(self, event, at: float) -> None:
        self.stats.add(event)
        if isinstance(event, Token):
            self._kind = event.provenance.value
            self.token_times.append(at)
            logprob = event.logprobs.logprob if event.logprobs is not None else None
            if self.rounds:  # what the stats counted as delivered in this round (it may be cut short)
                r = self.rounds[-1]
                closer = self._kind if self._kind in ("correction", "bonus") else r.closer
                self.rounds[-1] = r = replace(r, accepted=self.stats.accepted_in_round, delivered=r.delivered + 1,
                                              closer=closer)
                self.tokens.append(TokenPoint(event.id, self._kind, len(self.rounds), r.delivered - 1, logprob))
            else:
                self.tokens.append(TokenPoint(event.id, self._kind, 0, 0, logprob))
        elif isinstance(event, Round):
            since = self._last_round_at or (self.token_times[-1] if self.token_times else at)
            self.rounds.append(RoundPoint(event.drafted, 0, at - since, tuple(event.drafts), event.details,
                                          first=len(self.tokens), source=event.source))
            self._last_round_at = at

    def piece(self, token: int) -> str:
        """The text of one token id alone (for drafts that were never emitted), decoded once."""
        if token not in self._pieces:
            self._pieces[token] = self.decode([token]) if self.decode else f"<{token}>"
        return self._pieces[token]

    @property
    def rejected(self) -> List[int]:
        """Every refused draft id shown after a correction, in order."""
        return [t for r in self.rounds for t in r.rejected]

    @property
    def token_ids(self) -> List[int]:
        return self.stats.tokens

    @property
    def done(self) -> Optional[Done]:
        return self.stats.done

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def text(self, channel: str = "content") -> str:
        return "".join(s.text for s in self.spans if s.channel == channel)

    @property
    def drafted(self) -> int:
        return self.stats.draft_tokens

    @property
    def accepted(self) -> int:
        return self.stats.accepted_tokens

    @property
    def ttft_s(self) -> Optional[float]:
        return self.token_times[0] - self.submitted_at if self.token_times else None

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Decode speed: tokens after the first over the time from the first to the last."""
        if len(self.token_times) < 2 or self.token_times[-1] <= self.token_times[0]:
            return None
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])

    @property
    def tokens_per_round(self) -> Optional[float]:
        """GenerationStats.tokens_per_round: 1 + accepted drafts / rounds."""
        return self.stats.tokens_per_round

    @property
    def accepted_per_position(self) -> List[int]:
        """Delivered accepted drafts at each draft position (index i: position i + 1)."""
        return self.stats.accepted_per_position

    def acceptance_by_position(self) -> List[float]:
        """GenerationStats.acceptance_by_position: accepted at position i / rounds that drafted it."""
        return self.stats.acceptance_by_position()

    def by_source(self) -> Dict[str, GenerationStats]:
        """GenerationStats.sources, the sources that drafted: "head" and "copy", each its own counts."""
        return {name: c for name, c in sorted(self.stats.sources.items()) if c.draft_tokens}
