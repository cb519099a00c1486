"""Token ids in, outputs out: mlx-lm's streaming detokenizer, the <think> split, tool-call blocks and
stop strings.

Matching is on decoded text (mlx-lm's TextStateMachine, with the states mlx-lm's own server uses:
normal, reasoning, tool), so a stop string, a think tag or a tool-call marker is found however it
was tokenized, and text that may be the start of one is held back until it is not. The text of a
tool-call block goes to the request's ToolCallStream (parsers/), which turns it into calls.
"""

from typing import List, Optional, Sequence, Union

from mlx_lm.generate import TextStateMachine

from .outputs import TextDelta, ToolCallDelta
from .parsers import ToolCallStream

Piece = Union[TextDelta, ToolCallDelta]


def initial_channel(tokenizer, prompt: Sequence[int]) -> str:
    """"reasoning" when the prompt leaves a <think> block open (the template started it), else "normal"."""
    if getattr(tokenizer, "has_thinking", False):
        if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            return "reasoning"
    return "normal"


class TextAssembler:
    """Turns one request's token ids into content, reasoning and tool calls, and says when a stop
    string hit (or, for a request that allows one tool call, when that call is complete)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), split_reasoning: bool = False,
                 initial: str = "normal", tool_calls: Optional[ToolCallStream] = None):
        self.detokenizer = tokenizer.detokenizer  # a fresh copy per call
        self.calls = tool_calls
        self.stops = list(stop)
        transitions = {"normal": []}
        if split_reasoning and getattr(tokenizer, "has_thinking", False):
            transitions = {"normal": [(tokenizer.think_start, "reasoning")],
                           "reasoning": [(tokenizer.think_end, "normal")]}
        if tool_calls is not None:  # as mlx-lm's make_text_state_machine: a call may start in reasoning too
            for edges in transitions.values():
                edges.append((tool_calls.start, "tool"))
            transitions["tool"] = [(tool_calls.end, "normal")] if tool_calls.end else []
        for edges in transitions.values():
            edges.extend((s, None) for s in stop)  # None: the machine's terminal state
        self.machine = TextStateMachine(transitions)
        self.where = initial if initial in transitions else "normal"
        self.state = self.machine.make_state(self.where)
        self.stopped = False
        self.reasoning_tokens = 0  # tokens that arrived inside the reasoning block


    def matched_stop(self) -> Optional[str]:
        """The stop string that ended the text, if one did: the one completed first in the decoded
        text. (A request allowed one tool call also stops when that call is complete: none then.)"""
        if not self.stopped or not self.stops or (self.calls is not None and self.calls.done):
            return None
        text = self.detokenizer.text
        ends = [(text.find(s) + len(s), -len(s), s) for s in self.stops if s in text]
        return min(ends)[2] if ends else self.stops[0]

    def add(self, token: int) -> List[Piece]:
        """Outputs made printable by `token` (possibly none); sets `stopped` when a stop string completes."""
        self.reasoning_tokens += self.where == "reasoning"
        self.detokenizer.add_token(token)
        return self._split(self.detokenizer.last_segment)

    def finish(self) -> List[Piece]:
        """Whatever was held back (partial UTF-8, a partial tag that never completed), and the end
        of a tool-call block the answer stopped inside."""
        self.detokenizer.finalize()
        pieces = self._split(self.detokenizer.last_segment)
        if not self.stopped:
            self.state, rest, name = TextStateMachine.flush(self.state)
            pieces += self._pieces([(name, rest)])
        if self.calls is not None:
            if self.where == "tool":
                pieces += self.calls.close_block(complete=False)
            pieces += self.calls.finish()
        return pieces

    def _split(self, text: str) -> List[Piece]:
        if self.stopped or not text:
            return []
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._pieces(segments)

    def _pieces(self, segments) -> List[Piece]:
        out = []
        for name, text in segments:
            if name is None:
                self.stopped = True
                break
            if name == "tool":
                if self.where != "tool":
                    self.calls.open_block()
                self.where = name
                out += self.calls.feed(text) if text else []
                continue
            if self.where == "tool":  # the block's end marker
                self.where = name
                out += self.calls.close_block()
                if self.calls.done:  # its one call is complete: nothing after it is part of the answer
                    self.stopped = True
                    break
            self.where = name
            if name == "reasoning":
                out += [TextDelta("reasoning", text)] if text else []
            elif self.calls is not None:
                out += self.calls.content(text)
            elif text:
                out.append(TextDelta("content", text))
        return out
