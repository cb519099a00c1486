"""The drafts a speculative run made, and the greedy rule replayed by hand over them."""

from speculative.config import SpecConfig
from speculative.engine import DraftedRun
from speculative.events import Round, Token
from speculative.round.drafter import HeadDrafter


class RecordingDrafter(HeadDrafter):
    """The MTP head, appending each round's [k] draft tokens (row 0's), one array per round, to `log`."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def propose(self, rounds, budgets):
        drafts = super().propose(rounds, budgets)
        self.log.append(drafts.tokens[0, : drafts.lengths[0]])
        return drafts


def recording_drafter(log: list):
    """engine.generate's `drafter=`: the head, recording its drafts in `log`."""
    return RecordingDrafter(log)


def drafted(lm, params, depth, prefill_step=2048, draft_vocab=None, drafter=None, details=False, rng_seed=None):
    """One speculative generation (engine.DraftedRun: the driver at width 1) to run by hand:
    `.run(prompt)` yields its events, `.settle(n)` its state."""
    return DraftedRun(lm, params, SpecConfig("mtp", depth, draft_vocab, details), prefill_step, drafter,
                      rng_seed=rng_seed)


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
