"""System messages after the first message (agents send reminders and lists of sub-agents so): kept
as system turns where the chat template renders one there, else folded into a user turn as text.

Whether the template takes one is asked of the template itself, once per tokenizer: a conversation
with a system message between two user messages is rendered, and the template takes it when that
renders without an error and with the system text between the two. Qwen3.5's own templates refuse
it ("System message must be at the beginning."); the bundled dyno-tiny's renders it.

Folding keeps every earlier turn as it was rendered before, so the prefix cache still hits on the
next turn: a system message that follows a user turn is appended to it (the turn it belongs to, as
Anthropic's API reads it), one right after the leading system message to that; one after an assistant turn or a tool result goes at the start of the next
user turn, or, when none follows yet, is a user turn of its own.
"""

import weakref
from typing import List

_FIRST, _SYSTEM, _SECOND = "dyno-probe-first", "dyno-probe-system", "dyno-probe-second"
_PROBE = [{"role": "user", "content": _FIRST}, {"role": "system", "content": _SYSTEM},
          {"role": "user", "content": _SECOND}]
_TAKES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def takes_system_turns(tokenizer) -> bool:
    """True when the chat template renders a system message between user turns, in its place."""
    try:
        return _TAKES[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        text = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=False)
        takes = isinstance(text, str) and _placed(text)
    except Exception:  # a template that refuses it (raise_exception), or none at all
        takes = False
    try:
        _TAKES[tokenizer] = takes
    except TypeError:  # not weakly referable: asked again next time
        pass
    return takes


def _placed(text: str) -> bool:
    """The probe's system text is there, after the first user message and before the second."""
    return 0 <= text.find(_FIRST) < text.find(_SYSTEM) < text.find(_SECOND)


def place_system_turns(tokenizer, messages: List[dict]) -> List[dict]:
    """`messages` (as templates take them) with every system message but a leading one rendered as
    the template allows: unchanged where it takes system turns, else folded into user turns."""
    if not any(m["role"] == "system" for m in messages[1:]) or takes_system_turns(tokenizer):
        return messages
    out: List[dict] = []
    pending: List[str] = []  # system text waiting for the next user turn
    for i, message in enumerate(messages):
        if message["role"] != "system" or i == 0:
            if message["role"] == "user" and pending:
                message = {**message, "content": "\n\n".join(pending + [message["content"]])}
                pending = []
            out.append(message)
        elif out and out[-1]["role"] in ("system", "user") and not pending:  # the leading system, a user turn
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + message["content"]}
        else:
            pending.append(message["content"])
        if message["role"] == "assistant" and pending:  # no user turn came: the text is a turn of its own
            out.insert(len(out) - 1, {"role": "user", "content": "\n\n".join(pending)})
            pending = []
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out
