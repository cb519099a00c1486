"""Token ids in, text out: mlx-lm's streaming detokenizer, the <think> split and stop strings.

Matching is on decoded text (mlx-lm's TextStateMachine), so a stop string or a think tag is found
however it was tokenized, and text that may be the start of one is held back until it is not.
"""

from typing import List, Sequence, Tuple

from mlx_lm.generate import TextStateMachine

Piece = Tuple[str, str]  # (channel, text); channel is "content" or "reasoning"


def initial_channel(tokenizer, prompt: Sequence[int]) -> str:
    """"reasoning" when the prompt leaves a <think> block open (the template started it), else "normal"."""
    if getattr(tokenizer, "has_thinking", False):
        if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            return "reasoning"
    return "normal"


class TextAssembler:
    """Turns one request's token ids into content and reasoning text, and says when a stop string hit."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), split_reasoning: bool = False,
                 initial: str = "normal"):
        self.detokenizer = tokenizer.detokenizer  # a fresh copy per call
        transitions = {"normal": []}
        if split_reasoning and getattr(tokenizer, "has_thinking", False):
            transitions = {"normal": [(tokenizer.think_start, "reasoning")],
                           "reasoning": [(tokenizer.think_end, "normal")]}
        for edges in transitions.values():
            edges.extend((s, None) for s in stop)  # None: the machine's terminal state
        self.machine = TextStateMachine(transitions)
        self.state = self.machine.make_state(initial if initial in transitions else "normal")
        self.stopped = False

    def add(self, token: int) -> List[Piece]:
        """Text made printable by `token` (possibly none); sets `stopped` when a stop string completes."""
        self.detokenizer.add_token(token)
        return self._split(self.detokenizer.last_segment)

    def finish(self) -> List[Piece]:
        """Whatever was held back (partial UTF-8, a partial tag that never completed)."""
        self.detokenizer.finalize()
        pieces = self._split(self.detokenizer.last_segment)
        if not self.stopped:
            self.state, rest, name = TextStateMachine.flush(self.state)
            pieces += self._pieces([(name, rest)])
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
            elif text:
                out.append(("reasoning" if name == "reasoning" else "content", text))
        return out
