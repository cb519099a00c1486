"""Rows that join a batch together are prefilled together, as mlx-lm's BatchGenerator prefills its
prompts: each row's uncached tokens right-padded to the longest, the caches told each row's length
(attention never looks right of a row's own tokens, and a Gated DeltaNet state stops updating at its
row's end), then the padding rolled to the left, where the batch's rounds expect it.

A row resumed from the prompt cache starts from its own caches, merged left-padded beside the
others. Chunks end at every row's cuts, where that row's recurrent state is checkpointed for the
prompt cache, and hold at most `step` tokens in all (a lone prompt's chunk: the same peak memory).
The head runs one row behind the trunk: its row p pairs token p+1 with trunk hidden p.

Which rows share a pass: prompts of similar lengths (prefill_groups: a long one is not padded onto
short ones), and not two sharing a long prefix (sharing_waves: the later one waits for the first's
prompt state and resumes from it, as one after the other would).
"""

from typing import Dict, Hashable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..config import SamplingParams
from ..loader.vision import VisionInput
from ..prompt_cache.store import Checkpoint, Resume, common_prefix, owned, recurrent_state

PAD = 0  # the padding's token id: never seen by a real row (masked, then rolled out of reach)
PREFILL_STEP = 2048  # mlx-lm's generate_step default; the same chunking keeps caches identical


def segments(start: int, stop: int, cuts: Sequence[int], step: int) -> Iterator[Tuple[int, int]]:
    """Prefill chunks covering [start, stop): ending at every cut, at most `step` long, counted from
    the last cut, so a prompt resumed at a cut is chunked from there as a cold run chunks it."""
    s = start
    for end in [c for c in cuts if start < c < stop] + [stop]:
        while s < end:
            e = min(s + step, end)
            yield s, e
            s = e


class Joiner(NamedTuple):
    """A request joining the batch: its prompt, its resumed prefix, where to checkpoint, its depth."""

    row_id: Hashable
    prompt: Sequence[int]
    params: SamplingParams
    resume: Optional[Resume] = None  # caches that consumed the prompt's first len(resume) tokens
    cuts: Sequence[int] = ()  # positions at which to checkpoint the recurrent state
    depth: Optional[int] = None  # pinned draft depth (0: never drafts); None: the rounds'
    details: bool = False  # its Rounds carry each draft's p, q and acceptance chance
    rng_seed: Optional[int] = None  # an unseeded request's draws from it (Row), else a random seed
    vision: Optional[VisionInput] = None  # a prompt's images: their embeddings and M-RoPE positions
    copies: Optional[str] = None  # its drafts' source (round/copies.py: on, off, only); None: the drafter's


class Prefilled(NamedTuple):
    """The joiners' state after their prompts but each one's last token, and that token's pass."""

    hidden: mx.array  # [B, 1, H] the trunk hidden at each row's last prompt token
    logits: mx.array  # [B, V] the next token's logits, unprocessed
    checkpoints: List[Dict[int, Checkpoint]]  # row b's: resumed ones and those taken at its cuts


# Joiners share a prefill while padding them to the longest costs at most this many times their
# own tokens, or adds at most SLACK tokens (a short prompt's pass costs its fixed overhead anyway).
WASTE = 2.0
SLACK = 64


def resumed_at(j: Joiner) -> int:
    """How many of the joiner's prompt tokens its resumed caches already hold."""
    return len(j.resume) if j.resume is not None else 0


def uncached(j: Joiner) -> int:
    """The tokens a joiner's prefill feeds: its prompt after its resumed prefix."""
    return len(j.prompt) - resumed_at(j)


def prefill_groups(joiners: Sequence[Joiner]) -> List[List[Joiner]]:
    """The joiners in groups to prefill together, shortest first: a long prompt is not padded onto
    short ones (their rows would cost its length), and the short ones are not kept waiting behind it."""
    groups: List[List[Joiner]] = []
    for j in sorted(joiners, key=uncached):
        group = groups[-1] + [j] if groups else None
        if j.vision is None and group is not None and group[0].vision is None:  # an image prompt: a pass of its own
            padded, real = uncached(j) * len(group), sum(uncached(x) for x in group)
            if padded <= WASTE * real or padded - real <= SLACK:
                groups[-1] = group
                continue
        groups.append([j])
    return groups


def sharing_waves(prompts: Sequence[Sequence[int]], shared: int = SLACK) -> List[List[int]]:
    """Indices of `prompts` in waves to prefill one after another: a prompt sharing more than `shared`
    leading tokens with one in a wave (a system prompt, an agent's instructions) waits for a later
    wave, and resumes from that one's prompt state, kept meanwhile, instead of computing it again."""
    ids = [np.asarray(p) for p in prompts]
    waves: List[List[int]] = []
    for i, p in enumerate(ids):
        wave = next((w for w in waves if all(common_prefix(p, ids[j]) <= shared for j in w)), None)
        if wave is None:
            waves.append([i])
        else:
            wave.append(i)
    return waves


def row_state(trunk: List, b: int):
    """Row b's recurrent layers (store.recurrent_state of a batch's caches)."""
    return tuple(None if layer is None else tuple(None if a is None else a[b : b + 1] for a in layer)
                 for layer in recurrent_state(trunk))


def prefill_together(rounds, joiners: Sequence[Joiner], trunk: List, head: List, step: int) -> Prefilled:
    """Feed each joiner's prompt (after its resumed prefix) through `trunk` and `head`, batch caches
    whose row b is joiners[b] (its resumed prefix already in them), then each row's last token."""
    starts = [resumed_at(j) for j in joiners]
    lengths = [uncached(j) - 1 for j in joiners]  # fed before the last token
    width = max(lengths)
    pad = [width - n for n in lengths]
    tokens = mx.array([list(j.prompt[s : s + n]) + [PAD] * p for j, s, n, p in zip(joiners, starts, lengths, pad)])
    ahead = mx.array([list(j.prompt[s + 1 : s + 1 + n]) + [PAD] * p  # the head's: one position on
                      for j, s, n, p in zip(joiners, starts, lengths, pad)])
    # Cuts as columns; one at a row's last fed token (the prompt cache's usual last) ends a chunk too.
    cuts = [[c - s for c in j.cuts if s < c <= s + n] for j, s, n in zip(joiners, starts, lengths)]
    checkpoints = [dict(j.resume.checkpoints) if j.resume is not None else {} for j in joiners]
    padded = width > 0 and max(pad) > 0
    if padded:
        for c in trunk + head:
            c.prepare(lengths=lengths, right_padding=pad)
    # A prompt with images (alone in its pass) feeds its embeddings after its resumed prefix, at its
    # M-RoPE positions (rounds.rope).
    vision, resumed = joiners[0].vision, starts[0]
    rows = (lambda s, e: vision.embeddings[:, resumed + s : resumed + e]) if vision is not None else (lambda s, e: None)
    ends = sorted({c for row in cuts for c in row})  # every row's cuts end a chunk
    for s, e in segments(0, width, ends, max(1, step // len(joiners))):  # a chunk's tokens: a lone prompt's
        hidden = rounds.target.hidden(tokens[:, s:e], trunk, rows(s, e), rounds.rope)
        rounds._remember(ahead[:, s:e], hidden, rows(s + 1, e + 1), cache=head)  # row p = (t_{p+1}, h_p)
        mx.eval([c.state for c in trunk + head])
        rounds.memory.clear_cache()  # after each prefill chunk, as mlx-lm's generate_step
        for b, row_cuts in enumerate(cuts):
            if e in row_cuts:
                at = starts[b] + e
                checkpoints[b][at] = Checkpoint(at, owned(row_state(trunk, b)), mx.array(hidden[b : b + 1, -1:]))
    if padded:
        for c in trunk + head:
            c.finalize()
    last = mx.array([[j.prompt[-1]] for j in joiners])
    n = uncached(joiners[0])
    hidden = rounds.target.hidden(last, trunk, rows(n - 1, n), rounds.rope)  # [B, 1, H]
    return Prefilled(hidden, rounds.target.lm_head(hidden[:, -1]), checkpoints)
