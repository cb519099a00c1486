"""The drafts a speculative run made, and the greedy rule replayed by hand over them."""

from speculative.batched.decoding import Decoding, Request
from speculative.config import SpecConfig
from speculative.events import Round, Token
from speculative.round.depth_policy import DepthPolicy
from speculative.round.drafter import HeadDrafter

ROW = "run"


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


class OneRow:
    """One speculative generation run by hand, as engine.generate runs it (batched.Decoding, one row,
    at a fixed depth): `.run(prompt)` yields its events until the row finishes, `.settle(n)` its state;
    `.batch` is the driver, `.row` the row's state."""

    def __init__(self, lm, params, spec, prefill_step, drafter, rng_seed):
        self.decoding = Decoding(lm, spec, None, DepthPolicy(None, [], pinned=spec.draft_depth), prefill_step,
                                 drafter=drafter, clear_per_rounds=False, keep_states=True)
        self.batch = self.decoding.batch
        self.params, self.details, self.rng_seed = params, spec.details, rng_seed
        self.row = None

    def run(self, prompt, resume=None, cuts=(), vision=None):
        request = Request(ROW, list(prompt), self.params, details=self.details, rng_seed=self.rng_seed, vision=vision,
                          resume=resume, cuts=cuts)
        out = self.decoding.join_one(request)
        self.row = out.left.row if out.left is not None else self.decoding.row(ROW)
        while True:
            yield from out.events
            if out.finish is not None:
                return
            out = self.decoding.step()[ROW]

    @property
    def prompt(self):
        return self.row.prompt

    @property
    def generated(self):
        return self.row.generated

    def settle(self, emitted):
        return self.decoding.settle(ROW, emitted)


def drafted(lm, params, depth, prefill_step=2048, draft_vocab=None, drafter=None, details=False, rng_seed=None):
    """One speculative generation (OneRow) to run by hand."""
    return OneRow(lm, params, SpecConfig("mtp", depth, draft_vocab, details), prefill_step, drafter, rng_seed)


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
