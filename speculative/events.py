"""What the engine yields: tokens with provenance, per-round stats, and the end."""

import enum
from dataclasses import dataclass
from typing import List, Tuple


class Provenance(enum.Enum):
    """Where an emitted token came from."""

    DRAFT = "draft"  # a head draft the trunk accepted
    CORRECTION = "correction"  # the trunk's token replacing a rejected draft
    BONUS = "bonus"  # the trunk's extra token after a fully accepted round
    PLAIN = "plain"  # the trunk's token outside speculation (first token, plain decoding)

    @property
    def public(self) -> str:
        """The two-way label the CLI and API report: "draft" or "model"."""
        return "draft" if self is Provenance.DRAFT else "model"


@dataclass(frozen=True)
class Token:
    id: int
    provenance: Provenance


@dataclass(frozen=True)
class Round:
    """One draft/verify cycle: `accepted` of `drafted` drafts kept (always a prefix)."""

    drafted: int
    accepted: int

    @property
    def accepted_positions(self) -> Tuple[int, ...]:
        """1-based draft positions that were accepted."""
        return tuple(range(1, self.accepted + 1))

    def tally(self, per_position: List[int]) -> None:
        """Add this round's accepted positions to per-position counts, growing them to its depth."""
        per_position.extend([0] * (self.drafted - len(per_position)))
        for pos in self.accepted_positions:
            per_position[pos - 1] += 1


@dataclass(frozen=True)
class Done:
    """The end of a generation, with its timing."""

    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    reused_prompt_tokens: int = 0  # prompt tokens taken from a cached prefix instead of prefilled
