"""Frozen, validated settings: how to sample and how to speculate."""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional, Tuple, Union

from .errors import DynoError

if TYPE_CHECKING:  # constraints.py pulls in MLX and llguidance, which settings alone do not need
    from .constraints import Constraint
    from .thinking_budget import ThinkingBudget

MODES = ("auto", "mtp", "off")
COPY_SOURCES = ("on", "off", "only")  # drafts copied from the context: beside the head's, never, instead of them
MAX_DRAFT_DEPTH = 8
DEFAULT_DRAFT_DEPTH = 3
PENALTY_CONTEXT = 20  # mlx-lm's default window for repetition/presence/frequency penalties
MAX_LOGPROBS = 20  # top alternatives a token's log-probabilities may list (OpenAI's limit)
SEED_RANGE = 2**64  # mx.random.seed and mx.random.key take an unsigned 64-bit integer


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn; temperature 0 is the exact greedy path."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    seed: Optional[int] = None  # any integer; reduced modulo 2**64 (MLX's range), so equal seeds draw alike
    # Logits processors (mlx-lm's make_logits_processors): they depend only on the token prefix,
    # so the engine applies them to draft and target rows alike and drafting stays exact.
    logit_bias: Optional[Union[Mapping[int, float], Tuple[Tuple[int, float], ...]]] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = PENALTY_CONTEXT
    presence_penalty: float = 0.0
    presence_context_size: int = PENALTY_CONTEXT
    frequency_penalty: float = 0.0
    frequency_context_size: int = PENALTY_CONTEXT
    # Structured output (constraints.py): a grammar mask, also a function of the generated tokens.
    constraint: Optional["Constraint"] = None
    # At most this many tokens inside a <think> block, then Qwen's closing phrase (thinking_budget.py):
    # a function of the generated tokens too. None: thinking runs as long as the model likes.
    thinking_budget: Optional["ThinkingBudget"] = None
    # Log-probabilities on each Token event (events.TokenLogprobs): None or -1 for none, else the
    # number of top alternatives with each (0 for the emitted token's alone; at most MAX_LOGPROBS).
    logprobs: Optional[int] = None

    def __post_init__(self):
        def bad(what):
            raise DynoError(f"invalid sampling value: {what}")

        if self.logit_bias is not None:  # stored as sorted pairs so the dataclass stays hashable
            pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
            object.__setattr__(self, "logit_bias", tuple(sorted(pairs)) or None)
            for token, bias in self.logit_bias or ():
                if not isinstance(token, int) or token < 0:
                    bad(f"logit_bias keys must be token ids >= 0, got {token!r}")
                if not isinstance(bias, (int, float)) or not math.isfinite(bias):
                    bad(f"logit_bias values must be finite numbers, got {bias!r}")
        if self.repetition_penalty is not None and not (
            isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty < math.inf
        ):
            bad(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                bad(f"{name} must be an integer >= 1, got {value!r}")

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
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not -1 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer from -1 to {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.logprobs == -1:
            object.__setattr__(self, "logprobs", None)
        if self.constraint is not None:
            from .constraints import Constraint  # already loaded: the caller made one

            if not isinstance(self.constraint, Constraint):
                bad(f"constraint must be a Constraint (speculative.constraints), got {type(self.constraint).__name__}")
        if self.thinking_budget is not None:
            from .thinking_budget import ThinkingBudget

            if isinstance(self.thinking_budget, Mapping):  # as dataclasses.asdict left it (distributed orders)
                object.__setattr__(self, "thinking_budget", ThinkingBudget(**self.thinking_budget))
            if not isinstance(self.thinking_budget, ThinkingBudget):
                bad(f"thinking_budget must be a ThinkingBudget (speculative.thinking_budget), "
                    f"got {type(self.thinking_budget).__name__}")
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                bad(f"seed must be an integer, got {self.seed!r}")
            object.__setattr__(self, "seed", self.seed % SEED_RANGE)

    @classmethod
    def from_generation_config(cls, generation_config: Mapping, **given) -> "SamplingParams":
        """Values `given` (None: not given) over the model's generation_config.json over greedy.

        A config with `do_sample: false` asks for greedy decoding: its sampling values are ignored.
        """
        gc = generation_config if generation_config.get("do_sample", True) else {}
        values = {}
        for name, cast in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float)):
            value = given.pop(name, None)
            value = gc.get(name) if value is None else value
            if value is not None:
                values[name] = cast(value)
        return cls(**values, **{k: v for k, v in given.items() if v is not None})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """True when logit bias or a penalty (mlx-lm's processors) changes the logits."""
        return bool(self.logit_bias) or (self.repetition_penalty not in (None, 1.0)) or bool(
            self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def has_processors(self) -> bool:
        """True when logit bias, a penalty, a constraint or a thinking budget changes the logits before the warp."""
        return self.has_penalties or self.constraint is not None or self.thinking_budget is not None


@dataclass(frozen=True)
class SpecConfig:
    """Whether and how deep to draft with the MTP head."""

    mode: str = "auto"
    draft_depth: int = DEFAULT_DRAFT_DEPTH
    draft_vocab: Union[int, str, None] = None  # tokens the draft step scores: N, "auto" or None (all); draft_vocab/head.py
    # Round events carry p, q and the acceptance chance of each draft (events.RoundDetails): one
    # more device-to-host copy per round, so off unless a viewer asks.
    details: bool = False
    # Each batched round's depth (a round.depth_policy.DepthPolicy), decided with draft_depth when the
    # model was loaded (load_model); None: pinned at draft_depth. Shared by every request of that model.
    policy: object = field(default=None, compare=False, repr=False)
    copies: str = "off"  # COPY_SOURCES: drafts copied from the row's context (round/copies.py); the CLI's default is ModelOptions'

    def __post_init__(self):
        if self.copies not in COPY_SOURCES:
            raise DynoError(f"--copies must be one of {', '.join(COPY_SOURCES)}, got {self.copies!r}")
        if self.mode not in MODES:
            raise DynoError(f"--speculative must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.draft_depth, int) or not (1 <= self.draft_depth <= MAX_DRAFT_DEPTH):
            raise DynoError(
                f"draft depth must be an integer from 1 to {MAX_DRAFT_DEPTH}, got {self.draft_depth!r}"
            )
        if self.draft_vocab not in (None, "auto") and (not isinstance(self.draft_vocab, int) or self.draft_vocab < 1):
            raise DynoError(f"draft vocabulary must be a number of tokens >= 1, auto or full, got {self.draft_vocab!r}")
        if not isinstance(self.details, bool):
            raise DynoError(f"details must be true or false, got {self.details!r}")
