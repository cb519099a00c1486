"""The drafts a speculative run made, and the greedy rule replayed by hand over them."""

from speculative.engine import Speculator
from speculative.events import Round, Token


class RecordingSpeculator(Speculator):
    """A Speculator that appends its [k] draft tokens, one array per round, to `log`."""

    def __init__(self, *args, log: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def draft(self, k):
        tokens, probs = super().draft(k)
        self.log.append(tokens)
        return tokens, probs


def recording_runner(log: list):
    """engine.generate's `runner=`: a RecordingSpeculator appending to `log`."""
    return lambda lm, params, spec, prefill_step: RecordingSpeculator(
        lm, params, spec.draft_depth, prefill_step, spec.draft_vocab, log=log)


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


def rounds_with_tokens(events):
    """A run's events as (Round, the tokens delivered after it) pairs."""
    out = []
    for e in events:
        if isinstance(e, Round):
            out.append((e, []))
        elif isinstance(e, Token) and out:
            out[-1][1].append(e)
    return out
