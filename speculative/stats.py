"""Folding an event stream into the numbers users see (CLI line, JSON, /stats)."""

from dataclasses import dataclass, field
from typing import List, Optional

from .events import Done, Round, Token


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

    def add(self, event) -> None:
        if isinstance(event, Token):
            self.tokens.append(event.id)
            self.provenance.append(event.provenance.public)
        elif isinstance(event, Round):
            self.rounds += 1
            self.draft_tokens += event.drafted
            self.accepted_tokens += event.accepted
            event.tally(self.accepted_per_position)
        elif isinstance(event, Done):
            self.done = event

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
