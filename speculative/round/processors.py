"""Logit bias, repetition/presence/frequency penalties, a grammar and a thinking budget, applied
position by position.

The penalties are mlx-lm's own processors (`make_logits_processors`), then constraints.py's grammar
mask, then thinking_budget.py's rule (last: where it forces a token, nothing may unforce it), so
plain decoding and speculative decoding transform logits identically. Each one is a function of the token prefix only, which is what keeps drafting exact:
the row that scores position i (draft or target) is processed with the tokens before position i,
drafts included, exactly as plain decoding would have processed it had those drafts been its own
tokens.
"""

from typing import Callable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ..config import SamplingParams

Processor = Callable[[mx.array, mx.array], mx.array]


def processors_for(params: SamplingParams) -> List[Processor]:
    """The logits processors for these parameters (empty when none apply), fresh for one generation:
    mlx-lm's penalties, the constraint's grammar mask (it keeps a matcher per generation), then the
    thinking budget."""
    processors = []
    if params.has_penalties:
        processors = make_logits_processors(
            dict(params.logit_bias) if params.logit_bias else None,
            params.repetition_penalty,
            params.repetition_context_size,
            params.presence_penalty,
            params.presence_context_size,
            params.frequency_penalty,
            params.frequency_context_size,
        )
    if params.constraint is not None:
        processors.append(params.constraint.processor())
    if params.thinking_budget is not None:
        processors.append(params.thinking_budget.processor())
    return processors


def with_prefix(processors: Sequence[Processor], prefix: Sequence[int]) -> List[Processor]:
    """The same processors, seeing `prefix` before the history they are given.

    mlx-lm's generate_step only knows the tokens it was handed; when a cached prefix is skipped
    the penalties must still count it.
    """
    if not prefix or not processors:
        return list(processors)
    head = mx.array(list(prefix))
    return [lambda tokens, logits, p=p: p(mx.concatenate([head, tokens]), logits) for p in processors]


class PrefixProcessors:
    """A request's processors with the history window they need (the longest penalty context)."""

    def __init__(self, params: SamplingParams):
        self.processors = processors_for(params)
        self.window = max(params.repetition_context_size, params.presence_context_size,
                          params.frequency_context_size)
        # A grammar reads every generated token, and so does a thinking budget (its block may be long).
        self.whole_output = params.constraint is not None or params.thinking_budget is not None

    def __bool__(self) -> bool:
        return bool(self.processors)

    def tail(self, prompt: Sequence[int], generated: Sequence[int]) -> mx.array:
        """The last `window` tokens of prompt + generated: all any processor reads of them.

        With a grammar or a thinking budget, every generated token after the prompt's last `window`
        (penalties read only their window's end): the prompt part keeps its length, which is how
        those tell generated tokens from the prompt (they take their first call as the prompt).
        """
        w = self.window
        if self.whole_output:
            return mx.array(list(prompt[-w:]) + list(generated))
        return mx.array((list(prompt[-w:]) + list(generated[-w:]))[-w:])

    def row(self, logits: mx.array, history: mx.array, drafts: Optional[mx.array] = None) -> mx.array:
        """[1, V] logits after every processor, for the position after `history` then `drafts`."""
        if drafts is not None and drafts.size:
            history = mx.concatenate([history, drafts])
        for processor in self.processors:
            logits = processor(history, logits)
        return logits

    def rows(self, logits: mx.array, history: mx.array, drafts: Optional[mx.array] = None) -> mx.array:
        """[T, V] rows: row i is the position after `history` then drafts[:i]."""
        if logits.shape[0] == 1:
            return self.row(logits, history)
        return mx.concatenate(
            [self.row(logits[i : i + 1], history, drafts[:i]) for i in range(logits.shape[0])]
        )
