"""A thinking budget: at most `budget` tokens of the model's own inside a <think> block, then the
block is closed with Qwen's closing phrase, forced token by token.

The rule is a logits processor and a function of the generated tokens alone (round/processors.py): the
current block is found from where the last </think> and the <think>s around it stand, so a draft
row and a verify row see exactly what plain decoding would see at that position, and a rejected
draft leaves nothing to roll back. A block opens at a <think> (or is open from the start when the
prompt left one open, as Qwen's templates do with thinking on) and closes at the first </think>,
the model's own (which ends the rule) or the phrase's; a <think> inside an open block is only text.
Each block gets the budget. Once `budget` tokens of a block are out, every token but the phrase's
next one is masked; the phrase includes the "\\n\\n" after </think>, so those are forced too.

The count and the mask are MLX ops on the token array, never read back to the host: drafting
keeps its rounds free of syncs under a budget (a grammar, which needs the host, syncs anyway).
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import mlx.core as mx

from .errors import DynoError

# The phrase the Qwen3 model card gives for budget-limited thinking: what the models were trained
# to read as "answer now".
CLOSING_PHRASE = ("\n\nConsidering the limited time by the user, I have to give the solution based on "
                  "the thinking directly now.\n</think>\n\n")


@dataclass(frozen=True)
class ThinkingBudget:
    """The most tokens a think block may hold before it is closed, and the tokens that say so."""

    budget: int  # tokens of the model's own per block, >= 0
    start: int  # the <think> token
    end: int  # the </think> token
    phrase: Tuple[int, ...]  # the closing phrase's tokens: one `end` among them, no `start`
    open: bool = False  # the prompt leaves a block open: the first generated token is inside it

    def __post_init__(self):
        object.__setattr__(self, "phrase", tuple(self.phrase))
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 0:
            raise DynoError(f"the thinking budget must be an integer >= 0, got {self.budget!r}")
        if self.phrase.count(self.end) != 1 or self.start in self.phrase:
            raise DynoError("the closing phrase must hold one </think> and no <think>")

    def processor(self) -> "BudgetProcessor":
        """A fresh logits processor for one generation."""
        return BudgetProcessor(self)


def budget_for(lm, budget: int, prompt: Sequence[int]) -> Optional[ThinkingBudget]:
    """The budget for a generation after `prompt` with this model's think tokens and phrase; None when
    its tokenizer has no single-token <think> and </think> (nothing to count)."""
    tokenizer = lm.tokenizer
    if not getattr(tokenizer, "has_thinking", False):
        return None
    starts, ends = tokenizer.think_start_tokens, tokenizer.think_end_tokens
    if len(starts) != 1 or len(ends) != 1:
        return None
    phrase = tokenizer.encode(CLOSING_PHRASE.replace("</think>", tokenizer.think_end), add_special_tokens=False)
    opened = tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
    return ThinkingBudget(budget, starts[0], ends[0], tuple(phrase), opened)


class BudgetProcessor:
    """The budget's mask, called the mlx-lm way `(tokens, logits)`: as GrammarProcessor, it takes
    the tokens of its first call as the prompt and counts what follows them."""

    def __init__(self, spec: ThinkingBudget):
        self.spec = spec
        self.phrase = mx.array(spec.phrase, dtype=mx.int32)
        self.at_end = spec.phrase.index(spec.end)  # where </think> stands in the phrase
        self.prompt_length: Optional[int] = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.prompt_length is None:
            self.prompt_length = tokens.size
        forced = self.forced(tokens.reshape(-1)[self.prompt_length :])
        if forced is None:
            return logits
        ids = mx.arange(logits.shape[-1])
        only = mx.where(ids == forced, 0.0, -mx.inf).astype(logits.dtype)
        # Independent of the row's logits: a draft row of a reduced vocabulary may have the token at -inf.
        return mx.where(forced >= 0, only, logits)

    def forced(self, generated: mx.array) -> Optional[mx.array]:
        """The token the rule forces after `generated` as an int32 scalar (-1: none); None when no
        token can be forced (nothing generated and no block open from the prompt)."""
        s = self.spec
        n = generated.size
        if n == 0:
            return mx.array(s.phrase[0]) if s.open and s.budget == 0 else None
        none = mx.array(-(n + len(s.phrase) + s.budget + 2))  # a start no block has: every test below fails
        idx = mx.arange(n)
        is_end, is_start = generated == s.end, generated == s.start
        last_end = mx.max(mx.where(is_end, idx, -1))
        end_before = mx.max(mx.where(is_end & (idx < last_end), idx, -1))

        def opened_after(a: mx.array, b) -> mx.array:
            """Where the block that opens after position a (and before b) starts: 0 when it is the
            prompt's (a = -1, nothing closed yet), else just after the first <think> in (a, b)."""
            first = mx.min(mx.where(is_start & (idx > a) & (idx < b), idx, n))
            from_prompt = mx.array(s.open) & (a == -1)
            return mx.where(from_prompt, 0, mx.where(first < b, first + 1, none))

        # The open block, if any: after the last </think> (any block before it is closed).
        start = opened_after(last_end, n)
        j = n - start - s.budget  # how far into the phrase this position is
        inside = (start != none) & (j >= 0) & (j < len(s.phrase))
        # Else the phrase's tail after its </think>: the block that last </think> closed was forced shut.
        before = opened_after(end_before, last_end)
        tail = n - before - s.budget
        closed_by_phrase = (last_end >= 0) & (before != none) & (last_end - before - s.budget == self.at_end)
        in_tail = closed_by_phrase & (tail < len(s.phrase))
        last = len(s.phrase) - 1
        return mx.where(inside, self.phrase[mx.clip(j, 0, last)],
                        mx.where(in_tail, self.phrase[mx.clip(tail, 0, last)], -1))
