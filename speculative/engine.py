"""Generation: plain decoding through mlx-lm, or MTP draft -> verify -> accept -> rollback.

Both paths are generators of events (Token, Round, Done); text, streaming and statistics are
layers above. Drafting runs the one driver (batched.BatchSpeculator) at width 1: a generation is
a batch of one row, its drafts from the MTP head or any other drafter (round/drafter.py); prefill,
stopping and prefix reuse live outside the round.
"""

import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from .batched import BatchSpeculator, Leaving
from .batched.prefill import PREFILL_STEP, segments
from .config import SamplingParams, SpecConfig
from .errors import DynoError
from .events import Done, Provenance, Round, Token
from .heads.health import gives_up, watch
from .loader import LoadedModel
from .loader.vision import VisionInput
from .backend.memory import MLX_MEMORY, Memory
from .prompt_cache.store import Checkpoint, PrefixCache, PrefixEntry, Resume, owned, recurrent_state
from .round.copies import CopiesAndHead
from .round.drafter import Drafter
from .round.processors import processors_for, with_prefix
from .round.sampling import plain_sampler
from .round.scoring import scored

Event = Union[Token, Round, Done]


def generate(
    lm: LoadedModel,
    prompt: Sequence[int],
    params: SamplingParams,
    spec: SpecConfig = SpecConfig(),
    prefill_step: int = PREFILL_STEP,
    prefix_cache: Optional[PrefixCache] = None,
    boundaries: Sequence[int] = (),
    until: Optional[Callable[[], Optional[str]]] = None,
    drafter: Optional[Drafter] = None,
    memory: Memory = MLX_MEMORY,
    vision: Optional[VisionInput] = None,
    rng_seed: Optional[int] = None,
) -> Iterator[Event]:
    """Generate from `prompt` token ids; drafts with the MTP head unless off or headless.

    `vision` (loader/vision.image_prompt) carries a prompt's images: its embeddings and M-RoPE
    positions go into prefill; such a prompt bypasses the prefix cache (nothing is taken or kept).

    `drafter` (round/drafter.py) proposes the drafts instead of the MTP head (replayed drafts in
    benchmarks, the tests' adversarial drafters); `rng_seed`: an unseeded request's random draws
    from it (every rank of a split model alike), not a `seed`'s coupled rule. The model is wired
    while it decodes (`memory.wired`, as mlx-lm's stream_generate).

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
    keep = prefix_cache is not None and vision is None  # entries are keyed by tokens alone, which two images can share
    if drafts(lm, spec):
        runner = DraftedRun(lm, params, spec, prefill_step, drafter, memory, rng_seed)
    else:
        runner = PlainRun(lm, params, prefill_step, memory, rng_seed)
    resume, cuts = None, []
    if keep:
        resume = prefix_cache.take(prompt, head_layers=len(lm.head.layers) if drafts(lm, spec) else 0)
        cuts = prefix_cache.plan(len(prompt), boundaries, len(resume) if resume else 0)
    with memory.wired():
        steps = runner.run(prompt, resume, cuts, vision)
        eos = lm.eos_token_ids
        start = time.perf_counter()
        first_at = last_at = None
        n = 0
        reason = "length"
        try:
            while (event := next(steps, None)) is not None:  # (steps may change: see plain_after)
                if isinstance(event, Round):
                    watch(lm, event, spec.mode)
                    if (gives_up(lm, spec.mode) and isinstance(runner, DraftedRun) and not params.has_processors
                            and runner.row.keys is None):
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
            if keep and n:
                prefix_cache.put(runner.settle(n))
            raise
        steps.close()
        prefill = (first_at or start) - start
        decode = (last_at or start) - (first_at or start)
        if keep:
            prefix_cache.put(runner.settle(n))
    yield Done(reason, len(prompt), n, prefill, decode, len(resume) if resume else 0)


def drafts(lm: LoadedModel, spec: SpecConfig) -> bool:
    """True when a generation with `spec` drafts: speculation not off, a head loaded, and under "auto"
    not found collapsed (heads/health.py)."""
    return spec.mode != "off" and lm.head is not None and not gives_up(lm, spec.mode)


ROW = "generate"  # the one row's id in a generation's batch


class DraftedRun:
    """One speculative generation: the driver (batched.BatchSpeculator) at width 1, its row drafted at
    the request's fixed depth; `run` yields the row's events, `settle` hands back its state."""

    def __init__(self, lm: LoadedModel, params: SamplingParams, spec: SpecConfig, prefill_step: int,
                 drafter: Optional[Drafter] = None, memory: Memory = MLX_MEMORY, rng_seed: Optional[int] = None):
        # Its state is kept as it leaves: for the prefix cache, or for plain decoding to go on from.
        drafter = drafter if drafter is not None else CopiesAndHead(spec.copies)  # the head, and copies unless off
        self.batch = BatchSpeculator(lm, prefill_step, spec.draft_vocab, memory, True, drafter, clear_per_rounds=False)
        self.params, self.depth, self.details, self.rng_seed = params, spec.draft_depth, spec.details, rng_seed
        self.memory = memory
        self.row = None  # the row's state (round.row.Row) once it joined
        self.left: Optional[Leaving] = None  # its state once it finished in a round
        self.vision: Optional[VisionInput] = None

    def run(self, prompt: List[int], resume: Optional[Resume] = None, cuts: Sequence[int] = (),
            vision: Optional[VisionInput] = None) -> Iterator[Union[Token, Round]]:
        """Prefill (after `resume`'s prefix, if any), then rounds until the row finishes or the consumer stops."""
        self.vision = vision
        out = self.batch.join(ROW, prompt, self.params, resume, cuts, details=self.details, rng_seed=self.rng_seed,
                              vision=vision)
        self.row = out.left.row if out.left is not None else self.batch.rows[0] if len(self.batch) else None
        clearing = self.memory.per_tokens()  # generate_step's cadence (every 256 tokens), the first token counted
        while True:
            if out.finish is not None:  # (before its tokens: the consumer stops at the last one)
                self.left = out.left
            clearing.add(sum(isinstance(e, Token) for e in out.events))
            yield from out.events
            if out.finish is not None:
                return
            out = self.batch.step(self.depth)[ROW]

    @property
    def prompt(self) -> List[int]:
        return self.row.prompt

    @property
    def generated(self) -> List[int]:
        return self.row.generated

    def settle(self, emitted: int) -> PrefixEntry:
        """The caches settled to the prompt and the first `emitted` tokens minus the last (Leaving.settle)."""
        left, self.left = self.left or self.batch.leave(ROW), None
        if left is None:
            raise DynoError("the generation's state was not kept")
        return left.settle(emitted)


def plain_after(spec_run: DraftedRun, lm: LoadedModel, params: SamplingParams, prefill_step: int,
                emitted: int) -> Tuple["PlainRun", Iterator[Token]]:
    """A PlainRun (and its tokens) continuing `spec_run`'s generation after its first `emitted` tokens."""
    tokens = spec_run.prompt + spec_run.generated[:emitted]
    entry = spec_run.settle(emitted)
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



Runner = Union[DraftedRun, PlainRun]  # what `generate` drives: run(prompt, resume, cuts, vision), then settle(emitted)
