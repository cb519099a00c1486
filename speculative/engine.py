"""Generation: plain decoding through mlx-lm, or MTP draft -> verify -> accept -> rollback.

Both paths are generators of events (Token, Round, Done); text, streaming and statistics are
layers above. Drafting, a generation is one row of batched.Decoding (the one driver at width 1, and
the row's life around it: prefix reuse, prefill, settling), its drafts from the MTP head or any other
drafter (round/drafter.py). Without drafts it is mlx-lm's generate_step (PlainRun).
"""

import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from .batched.decoding import Decoding, Request, drafts
from .batched.prefill import PREFILL_STEP, segments
from .config import SamplingParams, SpecConfig
from .errors import DynoError
from .events import Done, Parked, Provenance, Round, Token
from .loader import LoadedModel
from .loader.vision import VisionInput
from .backend.memory import MLX_MEMORY, Memory
from .prompt_cache.store import Checkpoint, PrefixCache, PrefixEntry, Resume, owned, recurrent_state
from .round.depth_policy import DepthPolicy
from .round.drafter import Drafter
from .round.processors import processors_for, with_prefix
from .round.sampling import plain_sampler
from .round.scoring import scored

Event = Union[Token, Round, Parked, Done]


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

    Drafting, the generation is one row of batched.Decoding at the request's depth; each Round feeds
    the head's health (heads/health.py), and under "auto" a head found collapsed drafts no more.
    """
    if len(prompt) == 0:
        raise DynoError("the prompt is empty")
    prompt = list(prompt)
    if not drafts(lm, spec):
        yield from _plain(lm, prompt, params, prefill_step, prefix_cache, boundaries, until, memory, vision, rng_seed)
        return
    # The load's policy when it is for this depth (under "auto" the row adapts below it), else pinned.
    loaded = spec.policy if isinstance(spec.policy, DepthPolicy) and spec.policy.pinned == spec.draft_depth else None
    decoding = Decoding(lm, spec, prefix_cache, loaded or DepthPolicy(None, [], pinned=spec.draft_depth), prefill_step,
                        memory, drafter, clear_per_rounds=False, keep_prompts=False)
    request = Request(ROW, prompt, params, boundaries, details=spec.details, rng_seed=rng_seed, vision=vision)
    with memory.wired():
        n, reason = 0, None
        try:
            out = decoding.join_one(request)
            clearing = memory.per_tokens()  # generate_step's cadence (every 256 tokens), the first token counted
            while reason is None:
                clearing.add(sum(isinstance(e, Token) for e in out.events))
                for event in out.events:
                    n += isinstance(event, Token)  # (counted before it is yielded: a consumer may stop there)
                    yield event
                    if isinstance(event, Token) and (reason := _ended(event, n, lm.eos_token_ids, params, until)):
                        break
                if reason is None:
                    reason = out.finish  # (the driver cuts a row's tokens where _ended does)
                if reason is None:
                    out = decoding.step()[ROW]
        except GeneratorExit:  # the consumer stopped at a token: the caches are consistent there
            if n:
                decoding.finish(ROW, n, "cancelled")
            else:
                decoding.drop(ROW)
            raise
        except BaseException:
            decoding.drop(ROW)
            raise
        done = decoding.finish(ROW, n, reason)
    yield done


def _ended(token: Token, n: int, eos, params: SamplingParams, until) -> Optional[str]:
    """Why a generation ends after its n-th token `token`, or None."""
    if token.id in eos:
        return "stop"
    if n >= params.max_tokens:
        return "length"
    return until() if until is not None else None


def _plain(lm, prompt, params, prefill_step, prefix_cache, boundaries, until, memory, vision, rng_seed):
    """generate without drafts: mlx-lm's generate_step (PlainRun), with the same prefix reuse and Done."""
    runner = PlainRun(lm, params, prefill_step, memory, rng_seed)
    keep = prefix_cache is not None and vision is None  # entries are keyed by tokens alone, which two images can share
    resume, cuts = None, []
    if keep:
        resume = prefix_cache.take(prompt)
        cuts = prefix_cache.plan(len(prompt), boundaries, len(resume) if resume else 0)
    with memory.wired():
        steps = runner.run(prompt, resume, cuts, vision)
        start = time.perf_counter()
        first_at = last_at = None
        n, reason = 0, None
        try:
            for event in steps:
                now = time.perf_counter()
                first_at = first_at or now
                last_at = now
                n += 1
                yield event
                if (reason := _ended(event, n, lm.eos_token_ids, params, until)) is not None:
                    break
        except GeneratorExit:
            steps.close()
            if keep and n:
                prefix_cache.put(runner.settle(n))
            raise
        steps.close()
        if keep:
            prefix_cache.put(runner.settle(n))
    prefill = (first_at or start) - start
    decode = (last_at or start) - (first_at or start)
    yield Done(reason or "length", len(prompt), n, prefill, decode, len(resume) if resume else 0)


ROW = "generate"  # the one row's id in a generation's batch


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




