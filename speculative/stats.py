"""Folding an event stream into the numbers users see (CLI line, JSON, /stats, /metrics, bench).

Acceptance counts what was delivered: a round cut short (EOS, max_tokens, a stop string, a
cancel) drafted all its drafts but delivered only some of its accepted ones, so accepted drafts
are counted from the DRAFT tokens themselves, each at its position within its round.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from .events import Done, Provenance, Round, Token


@dataclass
class GenerationStats:
    """Running totals of one generation; `add` each event as it arrives."""

    draft_depth: Optional[int] = None
    tokens: List[int] = field(default_factory=list)
    provenance: List[str] = field(default_factory=list)
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: List[int] = field(default_factory=list)
    done: Optional[Done] = None
    _position: int = 0  # drafts delivered so far in the current round

    def add(self, event) -> None:
        if isinstance(event, Token):
            self.tokens.append(event.id)
            self.provenance.append(event.provenance.public)
            if event.provenance is Provenance.DRAFT:
                self._count_accepted(self._position)
                self._position += 1
        elif isinstance(event, Round):
            self.rounds += 1
            self.draft_tokens += event.drafted
            self._position = 0
            self._grow(event.drafted)
        elif isinstance(event, Done):
            self.done = event

    def _grow(self, depth: int) -> None:
        self.accepted_per_position.extend([0] * (depth - len(self.accepted_per_position)))

    def _count_accepted(self, index: int, n: int = 1) -> None:
        self._grow(index + 1)
        self.accepted_per_position[index] += n
        self.accepted_tokens += n

    def merge(self, other: "GenerationStats") -> None:
        """Add another generation's round and acceptance counts (not its tokens) to these."""
        self.rounds += other.rounds
        self.draft_tokens += other.draft_tokens
        for i, n in enumerate(other.accepted_per_position):
            self._count_accepted(i, n)

    @property
    def speculative(self) -> bool:
        return self.rounds > 0

    def summary_line(self) -> str:
        """The one-line report, e.g. `MTP: 512 tokens in 147 rounds (3.48 per round), 365/437 drafts accepted`."""
        n = len(self.tokens)
        if self.speculative:
            return (f"MTP: {n} tokens in {self.rounds} rounds ({n / self.rounds:.2f} per round), "
                    f"{self.accepted_tokens}/{self.draft_tokens} drafts accepted")
        rate = self.decode_tokens_per_s
        return f"Plain: {n} tokens, no drafting" + (f" ({rate:.1f} tok/s)" if rate else "")

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """Tokens after the first over the time from first to last token (prefill excluded)."""
        if self.done is None or self.done.decode_s <= 0 or len(self.tokens) < 2:
            return None
        return (len(self.tokens) - 1) / self.done.decode_s

    def speculative_json(self) -> dict:
        return {
            "mode": "mtp" if self.speculative else None,
            "draft_depth": self.draft_depth if self.speculative else None,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": self.accepted_per_position,
        }
