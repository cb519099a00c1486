"""Generation: plain decoding through mlx-lm, or MTP draft -> verify -> accept -> rollback.

Both paths are generators of events (Token, Round, Done); text, streaming and statistics are
layers above. The speculative round is round.Rounds.verify_round, which a Speculator runs for its
one row (`step`) and batched.BatchSpeculator for many; prefill, stopping and prefix reuse live
outside it.
"""

import time
from functools import partial
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from .rollback import GDNTape, rollback
from .round.rounds import Rounds, trim_to
from .round.row import Row
from .round.scoring import scored
from .config import SamplingParams, SpecConfig
from .errors import DynoError
from .events import Done, Provenance, Round, RoundDetails, Token
from .heads.health import gives_up, watch
from .loader import LoadedModel
from .loader.vision import VisionInput
from .backend.memory import MLX_MEMORY, Memory
from .prompt_cache.store import Checkpoint, PrefixCache, PrefixEntry, Resume, owned, recurrent_state
from .round.processors import processors_for, with_prefix
from .round.sampling import plain_sampler

Event = Union[Token, Round, Done]
PREFILL_STEP = 2048  # mlx-lm's generate_step default; the same chunking keeps caches identical


def generate(
    lm: LoadedModel,
    prompt: Sequence[int],
    params: SamplingParams,
    spec: SpecConfig = SpecConfig(),
    prefill_step: int = PREFILL_STEP,
    prefix_cache: Optional[PrefixCache] = None,
    boundaries: Sequence[int] = (),
    until: Optional[Callable[[], Optional[str]]] = None,
    runner: Optional[Callable[..., "Runner"]] = None,
    memory: Memory = MLX_MEMORY,
    vision: Optional[VisionInput] = None,
) -> Iterator[Event]:
    """Generate from `prompt` token ids; drafts with the MTP head unless off or headless.

    `vision` (loader/vision.image_prompt) carries a prompt's images: its embeddings and M-RoPE
    positions go into prefill; such a prompt bypasses the prefix cache (nothing is taken or kept).

    `runner(lm, params, spec, prefill_step)` makes the generation's runner (default `default_runner`:
    a Speculator when drafting, else a PlainRun); tools pass an instrumented one here. The model
    is wired while it decodes (`memory.wired`, as mlx-lm's stream_generate).

    With a `prefix_cache`, the longest reusable prefix of the prompt is not prefilled again;
    prefill is cut at `boundaries` (positions where later prompts may part from this one, e.g.
    where each chat message starts) and at the end of the prompt to checkpoint there, and the
    state after this generation is kept, settled to exactly the tokens the consumer received,
    whether it ends at EOS or max_tokens, when `until` returns a finish reason after a token (a
    stop string, a cancel), or when the consumer closes the generator. Not when the engine raised.

    Each Round feeds the head's health (heads/health.py); under "auto", once the head is found
    collapsed, plain decoding takes over from the tokens delivered.
    """
    if len(prompt) == 0:
        raise DynoError("the prompt is empty")
    prompt = list(prompt)
    runner = (runner or partial(default_runner, memory=memory))(lm, params, spec, prefill_step)
    resume, cuts = None, []
    if vision is not None:
        prefix_cache = None  # its entries are keyed by tokens alone, which two images can share
    if prefix_cache is not None:
        resume = prefix_cache.take(prompt, head_layers=len(lm.head.layers) if drafts(lm, spec) else 0)
        cuts = prefix_cache.plan(len(prompt), boundaries, len(resume) if resume else 0)
    with memory.wired():
        steps = runner.run(prompt, resume, cuts) if vision is None else runner.run(prompt, resume, cuts, vision=vision)
        eos = lm.eos_token_ids
        start = time.perf_counter()
        first_at = last_at = None
        n = 0
        reason = "length"
        try:
            while (event := next(steps, None)) is not None:  # (steps may change: see plain_after)
                if isinstance(event, Round):
                    watch(lm, event, spec.mode)
                    if (gives_up(lm, spec.mode) and isinstance(runner, Speculator) and not params.has_processors
                            and runner.keys is None):
                        # The head collapsed: the rest plainly, from the tokens delivered (this round's are
                        # dropped, and plain decoding makes them again). With processors the request drafts
                        # on: they would read the delivered tokens as prompt; seeded, it would restart the keys.
                        steps.close()
                        runner, steps = plain_after(runner, lm, params, prefill_step, n)
                        continue
                    yield event
                    continue
                now = time.perf_counter()
                first_at = first_at or now
                last_at = now
                n += 1
                yield event
                if event.id in eos:
                    reason = "stop"
                    break
                if n >= params.max_tokens:
                    break
                if until is not None and (why := until()) is not None:
                    reason = why
                    break
        except GeneratorExit:  # the consumer stopped at a token: the caches are consistent there
            steps.close()
            if prefix_cache is not None and n:
                prefix_cache.put(runner.settle(n))
            raise
        steps.close()
        prefill = (first_at or start) - start
        decode = (last_at or start) - (first_at or start)
        if prefix_cache is not None:
            prefix_cache.put(runner.settle(n))
    yield Done(reason, len(prompt), n, prefill, decode, len(resume) if resume else 0)


def drafts(lm: LoadedModel, spec: SpecConfig) -> bool:
    """True when a generation with `spec` drafts: speculation not off, a head loaded, and under "auto"
    not found collapsed (heads/health.py)."""
    return spec.mode != "off" and lm.head is not None and not gives_up(lm, spec.mode)


def default_runner(lm: LoadedModel, params: SamplingParams, spec: SpecConfig, prefill_step: int,
                   memory: Memory = MLX_MEMORY, rng_seed: Optional[int] = None) -> "Runner":
    """A Speculator when drafting, else a PlainRun; `rng_seed`: an unseeded request's random draws
    from it (every rank of a split model alike), not a `seed`'s coupled rule."""
    if drafts(lm, spec):
        return Speculator(lm, params, spec.draft_depth, prefill_step, spec.draft_vocab, spec.details, memory,
                          rng_seed)
    return PlainRun(lm, params, prefill_step, memory, rng_seed)


def segments(start: int, stop: int, cuts: Sequence[int], step: int) -> Iterator[Tuple[int, int]]:
    """Prefill chunks covering [start, stop): ending at every cut, at most `step` long, counted from
    the last cut, so a prompt resumed at a cut is chunked from there as a cold run chunks it."""
    s = start
    for end in [c for c in cuts if start < c < stop] + [stop]:
        while s < end:
            e = min(s + step, end)
            yield s, e
            s = e


def plain_after(spec_run: "Speculator", lm: LoadedModel, params: SamplingParams, prefill_step: int,
                emitted: int) -> Tuple["PlainRun", Iterator[Token]]:
    """A PlainRun (and its tokens) continuing `spec_run`'s generation after its first `emitted` tokens."""
    entry = spec_run.settle(emitted)
    tokens = spec_run.prompt + spec_run.generated[:emitted]
    plain = PlainRun(lm, params, prefill_step, spec_run.memory)
    resume = Resume(len(entry.tokens), entry.trunk_cache, checkpoints=entry.checkpoints)
    return plain, plain.run(tokens, resume, vision=spec_run.vision)


class PlainRun:
    """Plain decoding is mlx-lm's own generate_step: same output, same speed."""

    def __init__(self, lm: LoadedModel, params: SamplingParams, prefill_step: int, memory: Memory = MLX_MEMORY,
                 rng_seed: Optional[int] = None):
        self.model, self.params, self.prefill_step, self.vocab = lm.model, params, prefill_step, lm.vocab_size
        self.rng_seed = rng_seed  # MLX's global generator seeded from it when the request has no seed
        self.target = lm.target
        self.memory = memory  # generate_step clears MLX's buffer cache itself (every 256 tokens)
        self.cache: List = []
        self.fed: List[int] = []  # every token the cache holds
        self.checkpoints: Dict[int, Checkpoint] = {}

    def run(self, prompt: List[int], resume: Optional[Resume] = None, cuts: Sequence[int] = (),
            vision: Optional[VisionInput] = None) -> Iterator[Token]:
        """Tokens from generate_step, continuing from `resume`'s trunk cache when given.

        With `cuts`, the prompt up to the last cut is prefilled here (mlx-lm's calls, cut there)
        and checkpointed at each cut; generate_step takes the rest. With `vision`, generate_step
        drives the trunk at the image prompt's positions, from its embeddings (no cuts then).
        """
        p = self.params
        seed = p.seed if p.seed is not None else self.rng_seed
        if seed is not None:
            mx.random.seed(seed)
        sampler = plain_sampler(p, self.vocab)
        start = len(resume) if resume else 0
        self.cache = resume.trunk_cache if resume else make_prompt_cache(self.model)
        self.checkpoints = dict(resume.checkpoints) if resume else {}
        self.fed = list(prompt)
        model, embeddings = self.model, None
        if vision is not None:  # the trunk at the images' positions; the rows past them, after `resume`, are text
            model, cuts = self.target.positioned(vision.rope), ()
            n = vision.embeddings.shape[1]
            if start < n and len(prompt) != n:
                raise DynoError("a prompt with images resumes only past its images")
            embeddings = vision.embeddings[0, start:] if start < n else None
        cuts = [c for c in cuts if start < c < len(prompt)]
        for s, e in segments(start, cuts[-1] if cuts else start, cuts, self.prefill_step):
            self.model(mx.array(prompt[s:e])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.memory.clear_cache()  # after each prefill chunk, as generate_step
            if e in cuts:
                self.checkpoints[e] = Checkpoint(e, owned(recurrent_state(self.cache)))
        start = cuts[-1] if cuts else start
        for token, logprobs in generate_step(
            mx.array(prompt[start:]), model, max_tokens=-1, sampler=sampler,
            logits_processors=with_prefix(processors_for(p), prompt[:start]),
            prompt_cache=self.cache, prefill_step_size=self.prefill_step, input_embeddings=embeddings,
        ):
            self.fed.append(int(token))
            yield Token(int(token), Provenance.PLAIN, *scored(logprobs, [int(token)], p.logprobs))

    def settle(self, emitted: int) -> PrefixEntry:
        """The cache for reuse; generate_step feeds each token before yielding it, so it holds all."""
        return PrefixEntry(tuple(self.fed), self.cache, checkpoints=self.checkpoints)


def local_outcome(next_token: mx.array, n_accepted: Optional[mx.array] = None,
                  drafts: Optional[mx.array] = None) -> Tuple[int, int, List[int]]:
    """(next token, accepted count, drafts) as Python values: one host sync (one process)."""
    mx.eval(*(x for x in (next_token, n_accepted, drafts) if x is not None))
    return (next_token.item(), 0 if n_accepted is None else n_accepted.item(),
            [] if drafts is None else drafts.tolist())


class LastPass(NamedTuple):
    """The latest trunk pass, kept so that `settle` can roll the caches back to any emitted token."""

    tapes: List[GDNTape]  # what its GDN layers saw (empty after prefill: nothing to roll back)
    hidden: mx.array  # [1, T, H] trunk hiddens of the tokens it fed
    committed: int  # how many of those tokens were kept
    before: Optional[mx.array] = None  # [1, 1, H] trunk hidden of the token before its first one


def _on_row(name: str, doc: str) -> property:
    """A Speculator attribute that is its one Row's."""
    return property(lambda self: getattr(self.row, name), lambda self, v: setattr(self.row, name, v), doc=doc)


class Speculator(Rounds):
    """One speculative generation: the one-row case of the round (round.Rounds), on the request's own
    mlx-lm caches; its prefill, its prefix reuse (`settle`) and its events (`run`)."""

    def __init__(self, lm: LoadedModel, params: SamplingParams, depth: int, prefill_step: int,
                 draft_vocab: Optional[int] = None, details: bool = False, memory: Memory = MLX_MEMORY,
                 rng_seed: Optional[int] = None):
        super().__init__(lm, draft_vocab, memory)  # memory: cleared after each prefill chunk and every 256 tokens
        self.depth, self.prefill_step = depth, prefill_step
        self.row = Row(params, lm.eos_token_ids, lm.vocab_size, depth, rng_seed)
        self.rows = [self.row]
        self.trunk_cache = self.target.make_cache()
        self.head_cache = self.head.make_cache()
        # The round's outcome as Python values; split across processes, rank 0's for every rank.
        self.outcome = lm.ranks.outcome if lm.ranks is not None else local_outcome
        self.head_hidden: Optional[mx.array] = None  # [1, 1, H] head output of the last committed row
        self.pending: Optional[mx.array] = None  # [1] the token emitted but not yet fed to the trunk
        self.last_pass: Optional[LastPass] = None
        self.queued: Optional[Tuple[mx.array, Optional[mx.array]]] = None  # the next round's drafts, computing
        self.head_start = 0  # head cache rows before the queued drafts' recursion
        self.row.details = details  # also read each draft's p, q and acceptance chance (RoundDetails)
        self.drafted: List[int] = []  # the latest step's drafts, as verified
        self.round_details: Optional[RoundDetails] = None  # the latest step's, when `details`
        # While the head's health is checked, each round also reads where the target was confident
        # (Round.confident), with the round's sync; split across processes it is not checked.
        self.health = lm.head_health if lm.ranks is None else None
        self.confident: Tuple[bool, ...] = ()  # the latest step's, while checked
        self.vision: Optional[VisionInput] = None  # the prompt's images, when it has some
        self.rope = None  # their M-RoPE positions (target.MRoPE) for trunk and head; None: mlx-lm's RoPE

    params = _on_row("params", "the request's sampling parameters")
    eos = _on_row("eos", "the end-of-sequence token ids")
    prompt = _on_row("prompt", "the prompt's token ids")
    generated = _on_row("generated", "tokens emitted so far (the last one is still uncached)")
    processors = _on_row("processors", "the request's logits processors")
    key = _on_row("key", "the unseeded draws' RNG key")
    keys = _on_row("keys", "a seeded sampled request's KeyChain, else None")
    scores = _on_row("scores", "the latest prefill's or step's TokenLogprobs, one per emitted token")
    checkpoints = _on_row("checkpoints", "inherited from the resumed entry, and taken at cuts")
    details = _on_row("details", "whether its Rounds carry each draft's p, q and acceptance chance")

    # The row's rules, by the names drafters that subclass this one call.
    def _split(self) -> mx.array:
        return self.row.split()

    def _pick(self, logits: mx.array, ahead: int = 0):
        return self.row.pick(logits, ahead)

    def _history(self) -> mx.array:
        return self.row.history()

    def prefill(self, prompt: List[int], resume: Optional[Resume] = None, cuts: Sequence[int] = (),
                vision: Optional[VisionInput] = None):
        """Trunk over the prompt in mlx-lm's chunks, the head one row behind; returns t_n.

        `resume` holds caches that already consumed the prompt's first len(resume) tokens; at each
        of `cuts` a chunk ends and the recurrent state is checkpointed. `vision` gives a prompt with
        images its embeddings (trunk rows, and the head's row before each) and M-RoPE positions.
        """
        self.vision, self.rope = vision, vision.rope if vision is not None else None
        if vision is not None and resume is not None:
            raise DynoError("a prompt with images is not resumed from the prefix cache")
        embeds = vision.embeddings if vision is not None else None
        rows = (lambda s, e: embeds[:, s:e]) if embeds is not None else (lambda s, e: None)
        tokens = mx.array(prompt)[None]
        n = len(prompt)
        start = 0
        self.checkpoints = {}
        if resume is not None:
            start = len(resume)
            self.trunk_cache, self.head_cache = resume.trunk_cache, resume.head_cache
            self.checkpoints = dict(resume.checkpoints)
            if resume.hidden is not None:
                self._remember(tokens[:, start : start + 1], resume.hidden)  # the row it left open
        hidden = resume.hidden if resume is not None else None
        for s, e in segments(start, n - 1, cuts, self.prefill_step):
            hidden = self.target.hidden(tokens[:, s:e], self.trunk_cache, rows(s, e), self.rope)
            self._remember(tokens[:, s + 1 : e + 1], hidden, rows(s + 1, e + 1))  # row p = (t_{p+1}, h_p)
            mx.eval([c.state for c in self.trunk_cache + self.head_cache])
            self.memory.clear_cache()  # after each prefill chunk, as mlx-lm's generate_step
            if e in cuts:
                self.checkpoints[e] = Checkpoint(e, owned(recurrent_state(self.trunk_cache)), mx.array(hidden[:, -1:]))
        before = hidden[:, -1:] if hidden is not None else None  # h_{n-2}, when this run computed it
        hidden = self.target.hidden(tokens[:, n - 1 :], self.trunk_cache, rows(n - 1, n), self.rope)
        logits = self.row.process(self.target.lm_head(hidden[:, -1]))
        first = self.row.pick_target(logits)
        first_id = self.outcome(first)[0]
        first = mx.array([first_id], dtype=first.dtype)
        self.scores = self.row.scored(logits, [first_id])
        self.head_hidden = self._head(first[None], hidden)[:, -1:]  # row n-1 drafts position n+1
        self.pending = first
        self.last_pass = LastPass([], hidden[:, -1:], 1, before)
        return first

    def draft(self, k: int):
        """k head drafts by recursion: ([k] tokens, [k, V] draft probs or None when greedy)."""
        drafts, probs = self.draft_rows(k)
        return drafts[0], probs[0]

    def queue_drafts(self):
        """Draft the next round and start computing it: while the caller handles this round's
        tokens, and while Python builds the verify graph that reads the drafts."""
        self.head_start = self.head_cache[0].size()  # the draft recursion's rows start here
        self.queued = self.draft(self.depth)
        mx.async_eval(self.queued[0])
        return self.queued

    def _sync(self, nxt: mx.array, n_acc: mx.array, drafts: mx.array):
        next_id, a, drafted = self.outcome(nxt, n_acc, drafts[0])  # across ranks: rank 0's
        return [next_id], [a], [drafted]

    def step(self):
        """The round for this one row: verify the queued drafts in one trunk pass, keep the accepted
        prefix, roll back (round.Rounds.verify_round), and queue the next round's drafts.

        Returns (accepted draft tokens, next token); next is the correction or the bonus.
        """
        drafts, draft_probs = self.queued or self.queue_drafts()
        self.queued = None
        out = self.verify_round(drafts[None], [draft_probs], self.head_start, [self.depth])
        a, next_id = out.accepted[0], out.nxt[0]
        self.drafted = out.drafts[0]
        accepted = self.drafted[:a]
        self.round_details, self.confident = out.details[0], out.confident[0]
        self.scores = self.row.scored(out.processed[0], accepted + [next_id])  # rows 0..a: the tokens kept
        last = self.last_pass
        self.last_pass = LastPass(out.tapes, out.hidden, a + 1, last.hidden[:, last.committed - 1 : last.committed])
        self.generated += accepted + [next_id]
        if len(self.generated) < self.params.max_tokens and self.eos.isdisjoint(accepted + [next_id]):
            self.queue_drafts()  # not when this round ends the generation: no draft goes unverified
        return accepted, next_id

    def run(self, prompt: List[int], resume: Optional[Resume] = None, cuts: Sequence[int] = (),
            vision: Optional[VisionInput] = None) -> Iterator[Union[Token, Round]]:
        """Prefill (after `resume`'s prefix, if any), then rounds until the consumer stops iterating."""
        self.prompt = list(prompt)
        self.generated = [self.prefill(self.prompt, resume, cuts, vision).item()]
        yield Token(self.generated[0], Provenance.PLAIN, self.scores[0])
        clearing = self.memory.per_tokens()  # generate_step's cadence (every 256 tokens)
        clearing.add()  # the first token: generate_step counts it too
        while True:
            accepted, nxt = self.step()
            clearing.add(len(accepted) + 1)
            yield Round(self.depth, len(accepted), tuple(self.drafted), self.round_details, self.confident)
            for t, score in zip(accepted, self.scores):
                yield Token(t, Provenance.DRAFT, score)
            yield Token(nxt, Provenance.BONUS if len(accepted) == self.depth else Provenance.CORRECTION,
                        self.scores[-1])

    def settle(self, emitted: int) -> PrefixEntry:
        """The caches settled to the prompt and the first `emitted` tokens minus the last.

        The consumer may stop inside a round (EOS, max_tokens or a stop before its last token, or
        right after its Round event), leaving the trunk with committed tokens nobody received. The
        last emitted token stays out, as the pending token always does.
        """
        return settled(self.prompt, self.generated, emitted, self.trunk_cache, self.head_cache, self.last_pass,
                       self.checkpoints)


def settled(prompt: List[int], generated: List[int], emitted: int, trunk: List, head: Optional[List],
            last: LastPass, checkpoints: Dict[int, Checkpoint]) -> PrefixEntry:
    """One row's caches (holding `prompt` and `generated` but the last, `last` the pass that fed the
    latest of them) settled to the prompt and the first `emitted` tokens minus the last; `head`
    (None: none kept) holds a row per trunk position. A batch row that leaves settles here too."""
    tapes, hidden, committed, before = last
    keep = committed - (len(generated) - emitted)  # of the last pass's tokens
    # The caches hold `committed` tokens of that pass; the tapes restore any prefix of it.
    rollback(trunk, tapes, fed=committed, consumed=keep)
    tokens = tuple(prompt + generated[: emitted - 1])
    last_hidden = hidden[:, keep - 1 : keep] if keep else before
    if head is not None:  # one row short: that row pairs the last position with the next token
        trim_to(head, len(tokens) - 1)
    head = head if last_hidden is not None else None  # no hidden: its open row cannot be built
    return PrefixEntry(tokens, trunk, head, last_hidden, {p: cp for p, cp in checkpoints.items() if p < len(tokens)})


Runner = Union[Speculator, PlainRun]  # what `generate` drives: run(prompt, resume, cuts), then settle(emitted)
