"""The drafts a speculative run made, and the greedy rule replayed by hand over them."""

from speculative.engine import Speculator


def record_drafts(monkeypatch) -> list:
    """The engine's [k] draft tokens, one array per round, recorded as Speculator.draft returns them."""
    log, draft = [], Speculator.draft

    def recording(self, k):
        tokens, probs = draft(self, k)
        log.append(tokens)
        return tokens, probs

    monkeypatch.setattr(Speculator, "draft", recording)
    return log


def replay(drafts, reference, n):
    """The greedy rule replayed by hand: per round, how many drafts it keeps (the leading ones equal
    to plain greedy's `reference` at their positions), for rounds until `n` tokens are out."""
    kept, out = [], 1  # the first token comes from prefill
    for d in drafts:
        if out >= n:
            break
        a = 0
        while a < len(d) and d[a] == reference[out + a]:
            a += 1
        kept.append(a)
        out += a + 1
    return kept
