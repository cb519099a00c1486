"""Where chat prompts part: the positions where each message starts, from the model's chat template.

A later prompt of the same conversation shares every message before the one that changes (an
edit, a regenerate, a template that drops earlier <think> text or re-renders a tool call), so
the engine checkpoints its recurrent state there (speculative/prompt_cache/store.py). Qwen-family
templates open every message with one special token (<|im_start|>); it is learned from the
template itself, so any prompt (chat or raw, from either API or the playground) is split alike.
"""

from typing import List, Optional, Sequence

import numpy as np

_PROBE = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]


def message_marker(tokenizer) -> Optional[int]:
    """The special token the chat template puts at the start of every message, or None when it has none."""
    try:
        one = list(tokenizer.apply_chat_template(_PROBE[:1], tokenize=True, add_generation_prompt=False))
        three = list(tokenizer.apply_chat_template(_PROBE, tokenize=True, add_generation_prompt=False))
    except Exception:  # no template, or one that refuses this conversation
        return None
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    try:
        special |= set(tokenizer.get_added_vocab().values())  # <|im_start|> is an added token, not always "special"
    except Exception:
        pass
    # The first such token that opens each message once (a BOS before the first message does not).
    for t in one:
        if t in special and one.count(t) == 1 and three.count(t) == 3:
            return t
    return None


def message_starts(prompt: Sequence[int], marker: Optional[int]) -> List[int]:
    """Positions in `prompt` where a message starts (after the first)."""
    if marker is None or not len(prompt):
        return []
    return [int(i) for i in np.flatnonzero(np.asarray(prompt) == marker) if i > 0]
