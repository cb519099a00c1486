"""The drafting figures every answer carries, on every API (docs/server.md, "Drafting figures"):
one fold of the request's engine events (speculative.stats.GenerationStats), built here alone so
that the keys are the same everywhere."""

from typing import Optional

from speculative.stats import GenerationStats, tokens_sha256

SOURCE = "mtp"  # drafting's mode on the wire: the model's own MTP head drives every round
# Draft sources on the wire (GenerationStats.sources' keys): the head keeps the name it always had.
WIRE_SOURCES = {"head": SOURCE, "copy": "copy"}


def drafting_figures(stats: GenerationStats, drafting: bool, prompt_tokens: int, cached_tokens: int) -> dict:
    """What drafting did for one request: drafts made and kept (in all, by position, by source), its
    rounds by depth, its prompt and timing, and the hash of the token ids it generated.

    `drafting` False: the request did not draft (turned off for it, by the server, or no head);
    `rejected_tokens` is drafted minus accepted, so a round cut by a stop counts its undelivered
    drafts there."""
    done = stats.done
    prefill: Optional[float] = round(done.prefill_s, 6) if done is not None else None
    rate = stats.decode_tokens_per_s
    return {
        "mode": SOURCE if drafting else "off",
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "rejected_tokens": stats.draft_tokens - stats.accepted_tokens,
        "drafted_per_position": list(stats.drafted_per_position),
        "accepted_per_position": list(stats.accepted_per_position),
        "by_source": {WIRE_SOURCES.get(name, name): {"draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens}
                      for name, c in sorted(stats.sources.items()) if c.draft_tokens},
        "rounds": stats.rounds,
        "rounds_by_depth": {str(k): v for k, v in sorted(stats.rounds_by_depth.items())},
        "tokens_per_round": stats.tokens_per_round,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_tokens,
        "prefill_s": prefill,
        "decode_tokens_per_s": None if rate is None else round(rate, 3),
        "generated_tokens": len(stats.tokens),
        "tokens_sha256": tokens_sha256(stats.tokens),
    }
