"""What the engine yields: tokens with provenance, per-round stats, and the end."""

import enum
from dataclasses import dataclass
from typing import Optional, Tuple


class Provenance(enum.Enum):
    """Where an emitted token came from."""

    DRAFT = "draft"  # a head draft the trunk accepted
    COPY = "copy"  # a draft copied from the context (round/copies.py) the trunk accepted
    CORRECTION = "correction"  # the trunk's token replacing a rejected draft
    BONUS = "bonus"  # the trunk's extra token after a fully accepted round
    PLAIN = "plain"  # the trunk's token outside speculation (first token, plain decoding)

    @property
    def public(self) -> str:
        """The two-way label the CLI and API report: "draft" (the head's or a copy) or "model"."""
        return "draft" if self.drafted else "model"

    @property
    def drafted(self) -> bool:
        """An accepted draft, from either source."""
        return self is Provenance.DRAFT or self is Provenance.COPY


@dataclass(frozen=True)
class TokenLogprobs:
    """The target model's log-probability of an emitted token and its top alternatives.

    From the log-softmax of the model's logits at that position after the logits processors
    (penalties, logit bias, a grammar) and before the sampling warp (temperature, top-p, top-k,
    min-p): what mlx-lm's generate_step yields, and vLLM's default (the processed model
    distribution). Float32 values; `top` is (token id, log-probability) pairs, most likely first.
    """

    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Token:
    id: int
    provenance: Provenance
    logprobs: Optional[TokenLogprobs] = None  # only when SamplingParams.logprobs asked for them


@dataclass(frozen=True)
class RoundDetails:
    """Why each draft of a round was kept or not (SpecConfig.details), index i for draft i.

    Read from the rows the verify pass already computed, as logprobs are: `p` is the target's
    probability of the drafted token (the warped distribution when sampling; when greedy, the
    processed model distribution logprobs report), `q` the draft's (None when greedy: drafts are
    argmaxes), `accept` the chance it had: min(1, p/q), or when greedy 1.0 if it was the target's
    argmax else 0.0. Rows past the first rejection scored drafts under a refused prefix.
    `next_p` is the target's probability of the round's correction or bonus token.
    """

    p: Tuple[float, ...]
    q: Tuple[Optional[float], ...]
    accept: Tuple[float, ...]
    next_p: float


@dataclass(frozen=True)
class Round:
    """One draft/verify cycle: `accepted` of `drafted` drafts kept (always a prefix).

    It comes before the round's tokens; a consumer that stops inside the round receives fewer
    than `accepted` of its DRAFT tokens, so counts of what was delivered fold the tokens
    (speculative.stats.GenerationStats), not this field. `drafts` are the drafted ids (the ones
    past `accepted` were refused); `details` only when SpecConfig.details asked for them.
    `confident[i]`: the target's own top token had probability >= verify.CONFIDENT at draft i's
    position; only while the loaded head's health is being checked (empty otherwise).
    `source`: where the drafts came from, "head" (the MTP head) or "copy" (the row's context).
    `context`: tokens of context at the round, the row's prompt and generated tokens before it
    (its acceptance is reported by context band: stats.context_band).
    """

    drafted: int
    accepted: int
    drafts: Tuple[int, ...] = ()
    details: Optional[RoundDetails] = None
    confident: Tuple[bool, ...] = ()
    source: str = "head"
    context: int = 0


@dataclass(frozen=True)
class Parked:
    """A round a drafting row ran at depth 0 (the depth policy parked it, a collapsed head under
    "auto", or a drafter with nothing to propose, as copies alone without a match): no Round, one
    plain token follows. Only counted (stats.GenerationStats: the share of
    rounds parked); `context` as Round's. A row pinned at depth 0 never drafts and is never parked.
    """

    context: int


@dataclass(frozen=True)
class Done:
    """The end of a generation, with its timing."""

    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    reused_prompt_tokens: int = 0  # prompt tokens taken from a cached prefix instead of prefilled
