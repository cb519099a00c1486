"""Folding an event stream into the numbers users see (CLI line, JSON, /stats, /metrics, bench).

Acceptance counts what was delivered: a round cut short (EOS, max_tokens, a stop string, a
cancel) drafted all its drafts but delivered only some of its accepted ones, so accepted drafts
are counted from the DRAFT tokens themselves, each at its position within its round.
"""

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .events import Done, Parked, Round, Token

# Context bands acceptance is reported by: (name, the first context length past the band).
# Where published acceptance decays (issue 54): near 100 tokens, a few thousand, 8k-32k, beyond.
CONTEXT_BANDS: Tuple[Tuple[str, float], ...] = (("under_2k", 2048), ("2k_8k", 8192), ("8k_32k", 32768),
                                                ("over_32k", float("inf")))


def context_band(context: int) -> str:
    """The band of a round at `context` tokens of context: under_2k (< 2048), 2k_8k (< 8192),
    8k_32k (< 32768), over_32k."""
    return next(name for name, end in CONTEXT_BANDS if context < end)


def _grown(counts: List[int], length: int) -> None:
    counts.extend([0] * (length - len(counts)))


@dataclass
class GenerationStats:
    """Running totals of one generation; `add` each event as it arrives.

    The two derived figures every report shows are defined here and nowhere else:
    `tokens_per_round` and `acceptance_by_position()`.
    """

    draft_depth: Optional[int] = None
    tokens: List[int] = field(default_factory=list)
    provenance: List[str] = field(default_factory=list)
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: List[int] = field(default_factory=list)  # index i: draft position i + 1
    drafted_per_position: List[int] = field(default_factory=list)  # rounds that drafted position i + 1
    rounds_by_depth: Dict[int, int] = field(default_factory=dict)  # drafts a round made -> rounds
    done: Optional[Done] = None
    widths: Optional[Tuple[int, int]] = None  # in a batch: the fewest and the most rows of its rounds
    # The same counts per draft source ("head", "copy"): source -> GenerationStats of its rounds alone.
    sources: Dict[str, "GenerationStats"] = field(default_factory=dict)
    parked_rounds: int = 0  # rounds a drafting row ran at depth 0 (Parked): not in `rounds`
    # The same counts per context band (CONTEXT_BANDS), parked rounds included: band -> GenerationStats.
    bands: Dict[str, "GenerationStats"] = field(default_factory=dict)
    _position: int = 0  # drafts delivered so far in the current round
    _source: Optional[str] = None  # the current round's source
    _band: Optional[str] = None  # the current round's context band

    @classmethod
    def from_counts(cls, rounds: int, accepted_per_position: List[int],
                    drafted_per_position: List[int], parked_rounds: int = 0) -> "GenerationStats":
        """Stats of counts alone (no tokens), e.g. read back from a JSON record, to merge or derive from."""
        return cls(rounds=rounds, draft_tokens=sum(drafted_per_position),
                   accepted_tokens=sum(accepted_per_position),
                   accepted_per_position=list(accepted_per_position),
                   drafted_per_position=list(drafted_per_position), parked_rounds=parked_rounds)

    def add(self, event) -> None:
        if isinstance(event, Token):
            self.tokens.append(event.id)
            self.provenance.append(event.provenance.public)
            if event.provenance.drafted:
                self._count_accepted(self._position)
                if self._source is not None:
                    self.sources[self._source]._count_accepted(self._position)
                if self._band is not None:
                    self.bands[self._band]._count_accepted(self._position)
                self._position += 1
        elif isinstance(event, Round):
            self._count_round(event)
            self._source, self._band = event.source, context_band(event.context)
            self.sources.setdefault(event.source, GenerationStats())._count_round(event)
            self.bands.setdefault(self._band, GenerationStats())._count_round(event)
        elif isinstance(event, Parked):
            self.parked_rounds += 1
            self.bands.setdefault(context_band(event.context), GenerationStats()).parked_rounds += 1
        elif isinstance(event, Done):
            self.done = event

    def _count_round(self, event: Round) -> None:
        self.rounds += 1
        self.draft_tokens += event.drafted
        self.rounds_by_depth[event.drafted] = self.rounds_by_depth.get(event.drafted, 0) + 1
        self._position = 0
        self._count_drafted(event.drafted)

    def add_width(self, width: int) -> None:
        """One of its rounds ran beside others: `width` rows in all."""
        low, high = self.widths or (width, width)
        self.widths = (min(low, width), max(high, width))

    def _count_drafted(self, depth: int, n: int = 1) -> None:
        _grown(self.drafted_per_position, depth)
        _grown(self.accepted_per_position, depth)
        for i in range(depth):
            self.drafted_per_position[i] += n

    def _count_accepted(self, index: int, n: int = 1) -> None:
        _grown(self.accepted_per_position, index + 1)
        self.accepted_per_position[index] += n
        self.accepted_tokens += n

    def merge(self, other: "GenerationStats") -> None:
        """Add another generation's round and acceptance counts (not its tokens) to these."""
        self.rounds += other.rounds
        self.draft_tokens += other.draft_tokens
        _grown(self.drafted_per_position, len(other.drafted_per_position))
        _grown(self.accepted_per_position, len(other.drafted_per_position))
        for i, n in enumerate(other.drafted_per_position):
            self.drafted_per_position[i] += n
        for i, n in enumerate(other.accepted_per_position):
            self._count_accepted(i, n)
        for depth, n in other.rounds_by_depth.items():
            self.rounds_by_depth[depth] = self.rounds_by_depth.get(depth, 0) + n
        for source, counts in other.sources.items():
            self.sources.setdefault(source, GenerationStats()).merge(counts)
        self.parked_rounds += other.parked_rounds
        for band, counts in other.bands.items():
            self.bands.setdefault(band, GenerationStats()).merge(counts)

    @property
    def speculative(self) -> bool:
        return self.rounds > 0

    @property
    def accepted_in_round(self) -> int:
        """Drafts the current (last) round has delivered so far."""
        return self._position

    @property
    def tokens_per_round(self) -> Optional[float]:
        """Tokens per round: 1 + accepted drafts / rounds (None before the first round).

        vLLM's mean acceptance length: what one verify pass delivers on average, its accepted
        drafts plus the correction or bonus token. The prefill's first token belongs to no round
        and is left out, and a round cut short is not charged for the correction or bonus token a
        stop kept it from sending, so the figure is independent of the prefill and (but for the
        drafts a cut round did not deliver) of where the generation was cut.
        """
        return 1 + self.accepted_tokens / self.rounds if self.rounds else None

    @property
    def parked_share(self) -> Optional[float]:
        """Parked rounds / every round a drafting row ran, parked or not (None before the first)."""
        ran = self.rounds + self.parked_rounds
        return self.parked_rounds / ran if ran else None

    @property
    def acceptance(self) -> Optional[float]:
        """Accepted drafts / drafts, over every position (None before the first draft)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def acceptance_by_position(self) -> List[float]:
        """Per draft position (index i: position i + 1): drafts accepted there / rounds that drafted it.

        Counting the rounds that drafted each position keeps the share right when rounds differ in depth.
        """
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def summary_line(self) -> str:
        """The one-line report, e.g. `MTP: 512 tokens in 147 rounds (3.48 per round), 365/437 drafts accepted`
        (in a batch, followed by `, batch width 1-3`)."""
        n = len(self.tokens)
        if self.speculative:
            return (f"MTP: {n} tokens in {self.rounds} rounds ({self.tokens_per_round:.2f} per round), "
                    f"{self.accepted_tokens}/{self.draft_tokens} drafts accepted{self._copy_note()}{self._width_note()}")
        rate = self.decode_tokens_per_s
        return f"Plain: {n} tokens, no drafting" + (f" ({rate:.1f} tok/s)" if rate else "")

    def _copy_note(self) -> str:
        copies = self.sources.get("copy")
        if copies is None:
            return ""
        return f" ({copies.accepted_tokens}/{copies.draft_tokens} copied, in {copies.rounds} rounds)"

    def _width_note(self) -> str:
        if self.widths is None:
            return ""
        low, high = self.widths
        return f", batch width {low}" + (f"-{high}" if high != low else "")

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """Tokens after the first over the time from first to last token (prefill excluded)."""
        if self.done is None or self.done.decode_s <= 0 or len(self.tokens) < 2:
            return None
        return (len(self.tokens) - 1) / self.done.decode_s

    def speculative_json(self) -> dict:
        """The `speculative` object of `dyno generate --json` (and, over all requests, of /stats)."""
        return {
            "mode": "mtp" if self.speculative else None,
            "draft_depth": self.draft_depth if self.speculative else None,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": self.accepted_per_position,
            "drafted_per_position": self.drafted_per_position,
            "tokens_per_round": self.tokens_per_round,
            "acceptance_by_position": self.acceptance_by_position(),
            "by_source": self.by_source_json(),
            "parked_rounds": self.parked_rounds,
            "parked_share": self.parked_share,
            "by_context": self.by_context_json(),
        }

    def counts_json(self) -> dict:
        """The round and acceptance counts with their derived figures: a source's or a band's."""
        return {"rounds": self.rounds, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": self.accepted_per_position,
                "drafted_per_position": self.drafted_per_position,
                "tokens_per_round": self.tokens_per_round,
                "acceptance_by_position": self.acceptance_by_position()}

    def by_source_json(self) -> Dict[str, dict]:
        """Per draft source ("head", "copy"), the same figures over that source's rounds alone."""
        return {source: c.counts_json() for source, c in sorted(self.sources.items())}

    def by_context_json(self) -> Dict[str, dict]:
        """Per context band (every one of CONTEXT_BANDS, in order), the same figures over the rounds
        run at that context, with its overall acceptance and its parked rounds and their share."""
        out = {}
        for band, _ in CONTEXT_BANDS:
            c = self.bands.get(band) or GenerationStats()
            out[band] = {**c.counts_json(), "acceptance": c.acceptance, "parked_rounds": c.parked_rounds,
                         "parked_share": c.parked_share}
        return out

    @classmethod
    def from_json(cls, counts: dict) -> "GenerationStats":
        """counts_json's (or a band's) counts read back, to pool them."""
        return cls.from_counts(counts["rounds"], counts["accepted_per_position"], counts["drafted_per_position"],
                               counts.get("parked_rounds", 0))


def tokens_sha256(tokens: Sequence[int]) -> str:
    """SHA-256 (hex) of token ids as generated, each a 4-byte little-endian unsigned integer: equal
    hashes mean the same tokens, whatever text a stop string or detokenizing made of them."""
    return hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()
