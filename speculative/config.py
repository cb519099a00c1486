"""Frozen, validated settings: how to sample and how to speculate."""

import math
from dataclasses import dataclass
from typing import Optional

from .errors import DynoError

MODES = ("auto", "mtp", "off")
MAX_DRAFT_DEPTH = 8
DEFAULT_DRAFT_DEPTH = 3


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn; temperature 0 is the exact greedy path."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    seed: Optional[int] = None

    def __post_init__(self):
        def bad(what):
            raise DynoError(f"invalid sampling value: {what}")

        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            bad(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpecConfig:
    """Whether and how deep to draft with the MTP head."""

    mode: str = "auto"
    draft_depth: int = DEFAULT_DRAFT_DEPTH

    def __post_init__(self):
        if self.mode not in MODES:
            raise DynoError(f"--speculative must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.draft_depth, int) or not (1 <= self.draft_depth <= MAX_DRAFT_DEPTH):
            raise DynoError(
                f"draft depth must be an integer from 1 to {MAX_DRAFT_DEPTH}, got {self.draft_depth!r}"
            )
