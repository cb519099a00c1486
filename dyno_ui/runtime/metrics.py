"""Server counters: Prometheus text for /metrics (prometheus_client) and the JSON of /stats.

Both are updated once per request from the request's GenerationStats fold, so they move by
exactly what that request drafted, accepted and generated; tokens per round and acceptance by
position are GenerationStats' own figures over every request so far. Metric names follow vLLM's
with the `mlx:` prefix.
"""

import threading
from dataclasses import dataclass
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from speculative.heads.health import HeadHealth
from speculative.stats import CONTEXT_BANDS, GenerationStats

WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, float("inf"))
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, float("inf"))
ROUND_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, float("inf"))
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, float("inf"))


@dataclass(frozen=True)
class Outcome:
    """What one finished (or cancelled) request contributes to the counters."""

    stats: GenerationStats
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    cached_tokens: int
    latency_s: float
    ttft_s: Optional[float]


class ServerMetrics:
    """A private registry (several servers can live in one process) plus JSON totals."""

    def __init__(self, draft_depth: Optional[int]):
        self.registry = r = CollectorRegistry()
        self.draft_tokens = Counter("mlx:draft_tokens", "Tokens drafted by the MTP head", registry=r)
        self.accepted_tokens = Counter("mlx:draft_tokens_accepted", "Drafted tokens the model accepted",
                                       registry=r)
        self.accepted_per_position = Counter(
            "mlx:draft_tokens_accepted_per_position", "Accepted drafts by 1-based draft position",
            ["position"], registry=r)
        self.drafted_per_position = Counter(
            "mlx:draft_tokens_drafted_per_position", "Rounds that drafted each 1-based draft position",
            ["position"], registry=r)
        self.rounds = Counter("mlx:spec_decode_rounds", "Draft/verify rounds", registry=r)
        self.tokens_per_round = Gauge(
            "mlx:spec_decode_tokens_per_round",
            "Tokens per round over all requests: 1 + accepted drafts / rounds (vLLM's mean acceptance length)",
            registry=r)
        self.tokens_per_round.set(float("nan"))  # undefined until a round has run
        self.acceptance_by_position = Gauge(
            "mlx:draft_acceptance_by_position",
            "Over all requests: drafts accepted at each 1-based position / rounds that drafted it",
            ["position"], registry=r)
        # The same by draft source: "head" (the MTP head) or "copy" (copied from the context).
        self.source_draft_tokens = Counter("mlx:draft_tokens_by_source", "Tokens drafted, by source", ["source"],
                                           registry=r)
        self.source_accepted_tokens = Counter("mlx:draft_tokens_accepted_by_source", "Drafted tokens accepted, by source",
                                              ["source"], registry=r)
        self.source_tokens_per_round = Gauge(
            "mlx:spec_decode_tokens_per_round_by_source",
            "Over all requests: 1 + accepted drafts / rounds, over the rounds each source drafted", ["source"], registry=r)
        self.source_acceptance_by_position = Gauge(
            "mlx:draft_acceptance_by_source_position",
            "Over all requests: drafts accepted at each 1-based position / rounds that drafted it, by source",
            ["source", "position"], registry=r)
        # The same by the context a round ran at (speculative.stats.CONTEXT_BANDS), and the rounds parked.
        self.band_rounds = Counter("mlx:spec_decode_rounds_by_context",
                                   "Draft/verify rounds, by context band at the round", ["band"], registry=r)
        self.band_parked = Counter("mlx:spec_decode_rounds_parked_by_context",
                                   "Rounds a drafting request ran at depth 0 (parked), by context band", ["band"],
                                   registry=r)
        self.band_draft_tokens = Counter("mlx:draft_tokens_by_context", "Tokens drafted, by context band", ["band"],
                                         registry=r)
        self.band_accepted_tokens = Counter("mlx:draft_tokens_accepted_by_context",
                                            "Drafted tokens accepted, by context band", ["band"], registry=r)
        self.band_acceptance = Gauge("mlx:draft_acceptance_by_context",
                                     "Over all requests: accepted drafts / drafts, by context band", ["band"],
                                     registry=r)
        self.parked_share = Gauge("mlx:spec_decode_parked_share",
                                  "Over all requests: parked rounds / all rounds of drafting requests", registry=r)
        self.parked_share.set(float("nan"))  # undefined until a round has run
        for band, _ in CONTEXT_BANDS:  # every band exported from the start (its acceptance undefined)
            for m in (self.band_rounds, self.band_parked, self.band_draft_tokens, self.band_accepted_tokens):
                m.labels(band=band)
            self.band_acceptance.labels(band=band).set(float("nan"))
        self.prompt_tokens = Counter("mlx:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("mlx:prompt_tokens_cached", "Prompt tokens reused from a cached prefix",
                                     registry=r)
        self.generation_tokens = Counter("mlx:generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("mlx:requests", "Requests by finish reason", ["finish_reason"], registry=r)
        self.thinking_only = Counter("mlx:requests_ended_in_thinking",
                                     "Chat answers that ended inside their think block with no visible text",
                                     registry=r)
        self.latency = Histogram("mlx:e2e_request_latency_seconds", "Arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("mlx:time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.batch_width = Gauge("mlx:batch_width", "Requests being decoded together now", registry=r)
        self.round_width = Histogram("mlx:batch_round_width", "Requests decoded together in each round",
                                     buckets=WIDTH_BUCKETS, registry=r)
        self.rounds_by_depth = Counter("mlx:batch_rounds_by_depth",
                                       "Rounds by the draft depth chosen for them (0: plain decoding)", ["depth"],
                                       registry=r)
        self.round_seconds = Histogram("mlx:batch_round_seconds",
                                       "Wall time of each batched round, by the draft depth chosen for it",
                                       ["depth"], buckets=ROUND_BUCKETS, registry=r)
        self.head_collapsed = Gauge(
            "mlx:mtp_head_collapsed",
            "1 when the loaded MTP head's drafts were found to fail where the model is confident, else 0",
            registry=r)
        self._lock = threading.Lock()
        self._width = self._max_width = 0
        self._rounds_by_width: dict = {}
        self._rounds_by_depth: dict = {}
        self._round_time: dict = {}  # (width, depth) -> [timed rounds, seconds]
        self.set_draft_depth(draft_depth)
        self._totals = GenerationStats(draft_depth=draft_depth)
        self._requests = {"stop": 0, "length": 0, "cancelled": 0, "failed": 0}
        self._prompt = self._cached = self._generated = 0
        self._thinking_only = 0

    def set_draft_depth(self, draft_depth: Optional[int]) -> None:
        """The depth requests are drafted at now (None: no drafting), e.g. after a model swap."""
        with self._lock:
            self.draft_depth = draft_depth
        for pos in range(1, (draft_depth or 0) + 1):
            self.accepted_per_position.labels(position=str(pos))  # exported as 0 before any request
            self.drafted_per_position.labels(position=str(pos))
            self.acceptance_by_position.labels(position=str(pos))

    def watch_head(self, health: Callable[[], Optional[HeadHealth]]) -> None:
        """Export the served head's health, read through `health` at each scrape (a model swap changes it)."""
        self.head_collapsed.set_function(lambda: float(bool((h := health()) is not None and h.collapsed)))

    def set_width(self, width: int) -> None:
        """How many requests are being decoded together now (called as they join and leave)."""
        self.batch_width.set(width)
        with self._lock:
            self._width = width
            self._max_width = max(self._max_width, width)

    def record_round(self, width: int, depth: int, seconds: Optional[float] = None) -> None:
        """One round of `width` requests at draft depth `depth`, taking `seconds` when timed (called
        on the engine thread)."""
        self.round_width.observe(width)
        self.rounds_by_depth.labels(depth=str(depth)).inc()
        if seconds is not None:
            self.round_seconds.labels(depth=str(depth)).observe(seconds)
        with self._lock:
            if seconds is not None:
                timed = self._round_time.setdefault((width, depth), [0, 0.0])
                timed[0] += 1
                timed[1] += seconds
            self._max_width = max(self._max_width, width)
            self._rounds_by_width[width] = self._rounds_by_width.get(width, 0) + 1
            self._rounds_by_depth[depth] = self._rounds_by_depth.get(depth, 0) + 1

    def record(self, outcome: Outcome) -> None:
        """Count one request (called on the engine thread)."""
        s = outcome.stats
        self.draft_tokens.inc(s.draft_tokens)
        self.accepted_tokens.inc(s.accepted_tokens)
        for pos, n in enumerate(s.accepted_per_position, start=1):
            self.accepted_per_position.labels(position=str(pos)).inc(n)
        for pos, n in enumerate(s.drafted_per_position, start=1):
            self.drafted_per_position.labels(position=str(pos)).inc(n)
        self.rounds.inc(s.rounds)
        for source, c in s.sources.items():
            self.source_draft_tokens.labels(source=source).inc(c.draft_tokens)
            self.source_accepted_tokens.labels(source=source).inc(c.accepted_tokens)
        for band, c in s.bands.items():
            self.band_rounds.labels(band=band).inc(c.rounds)
            self.band_parked.labels(band=band).inc(c.parked_rounds)
            self.band_draft_tokens.labels(band=band).inc(c.draft_tokens)
            self.band_accepted_tokens.labels(band=band).inc(c.accepted_tokens)
        self.prompt_tokens.inc(outcome.prompt_tokens)
        self.cached_tokens.inc(outcome.cached_tokens)
        self.generation_tokens.inc(len(s.tokens))
        self.requests.labels(finish_reason=outcome.finish_reason).inc()
        self.latency.observe(outcome.latency_s)
        if outcome.ttft_s is not None:
            self.ttft.observe(outcome.ttft_s)
        with self._lock:
            self._totals.merge(s)
            self._set_derived(self._totals)
            self._requests[outcome.finish_reason] = self._requests.get(outcome.finish_reason, 0) + 1
            self._prompt += outcome.prompt_tokens
            self._cached += outcome.cached_tokens
            self._generated += len(s.tokens)

    def _set_derived(self, totals: GenerationStats) -> None:
        if totals.tokens_per_round is not None:
            self.tokens_per_round.set(totals.tokens_per_round)
        for pos, rate in enumerate(totals.acceptance_by_position(), start=1):
            self.acceptance_by_position.labels(position=str(pos)).set(rate)
        for source, c in totals.sources.items():
            if c.tokens_per_round is not None:
                self.source_tokens_per_round.labels(source=source).set(c.tokens_per_round)
            for pos, rate in enumerate(c.acceptance_by_position(), start=1):
                self.source_acceptance_by_position.labels(source=source, position=str(pos)).set(rate)
        for band, c in totals.bands.items():
            if c.acceptance is not None:
                self.band_acceptance.labels(band=band).set(c.acceptance)
        if totals.parked_share is not None:
            self.parked_share.set(totals.parked_share)

    def record_failure(self) -> None:
        """Count a request the engine could not complete."""
        self.requests.labels(finish_reason="failed").inc()
        with self._lock:
            self._requests["failed"] += 1

    def record_thinking_only(self) -> None:
        """Count a chat answer that ended inside its think block with no visible text (called on the
        engine thread, after the request itself was counted)."""
        self.thinking_only.inc()
        with self._lock:
            self._thinking_only += 1

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)

    def stats_json(self) -> dict:
        """The /stats document."""
        with self._lock:
            spec = self._totals.speculative_json()
            depth = self.draft_depth or 0
            padded = {k: spec[k] + [0] * (depth - len(spec[k]))  # every position of the depth, from the start
                      for k in ("accepted_per_position", "drafted_per_position", "acceptance_by_position")}
            return {
                "speculative": {**spec, "mode": "mtp" if self.draft_depth else None,
                                "draft_depth": self.draft_depth, **padded},
                "requests": {"total": sum(self._requests.values()), **self._requests,
                             "ended_in_thinking": self._thinking_only},
                "tokens": {"prompt": self._prompt, "prompt_cached": self._cached,
                           "generated": self._generated},
                "batch": {"width": self._width, "max_width": self._max_width,
                          "rounds_by_width": {str(k): v for k, v in sorted(self._rounds_by_width.items())},
                          "rounds_by_depth": {str(k): v for k, v in sorted(self._rounds_by_depth.items())},
                          "round_ms": self._round_ms()},
            }

    def _round_ms(self) -> dict:
        """Mean milliseconds of the timed rounds, by width, then depth (under the lock)."""
        out: dict = {}
        for (width, depth), (n, seconds) in sorted(self._round_time.items()):
            out.setdefault(str(width), {})[str(depth)] = round(1e3 * seconds / n, 3)
        return out
