"""Tool-call parsing: the model's tool-call text as calls (id, function name, JSON arguments), streamed.

mlx-lm picks a model's tool-call format from its chat template (TokenizerWrapper.tool_parser,
tool_call_start, tool_call_end); each format has one module here, named like mlx-lm's parser:

  json_tools   Qwen's JSON form:   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
  qwen3_coder  Qwen3.5's XML form: <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
               </function>\\n</tool_call>
  whole        any other format mlx-lm knows: parsed by mlx-lm once its block closes

Each module's BlockParser reads the text of one block (between the markers) as it arrives and
returns CallPieces: a call's name as soon as it is known, then its arguments in pieces. Parsing
the complete text is mlx-lm's own parser's job in every module; the modules add the streaming.

Any API uses it the same way (it imports nothing from the web layer):

    calls = ToolCallStream.for_tokenizer(lm.tokenizer, tools, parallel=True)  # None: no format
    text = TextAssembler(lm.tokenizer, stops, split_reasoning=True, tool_calls=calls)

The TextAssembler sends the text between the markers to `feed`, the end of a block to
`close_block` and the answer's other text to `content`; out come TextDelta and ToolCallDelta
(outputs.py). A block that holds no call it can parse comes back as content, markers included,
so no text is lost (marked `cut` when the answer ended inside it); `calls.cut` lists the calls of
a block the answer ended inside. `calls.made` counts the calls (an API's finish reason: "tool_calls",
"tool_use"); `calls.done` says that a non-parallel request has its one call.
"""

import logging
import uuid
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from ..outputs import TextDelta, ToolCallDelta
from . import json_tools, qwen3_coder, whole
from .pieces import CallPiece

log = logging.getLogger("dyno.serve")

# mlx-lm's parser module -> (our streaming module, the form speculative.constraints can force).
FORMATS = {"json_tools": (json_tools, "json"), "qwen3_coder": (qwen3_coder, "xml")}


@dataclass(frozen=True)
class ToolCallFormat:
    """A model's tool-call format: its markers, its parser module, and the form a constraint can force."""

    name: str  # mlx-lm's parser module: json_tools, qwen3_coder, ...
    start: str
    end: str
    parser: Callable  # (tools) -> BlockParser
    form: Optional[str]  # "json" or "xml" (speculative.constraints.ToolCalls), else None


def tool_call_format(tokenizer) -> Optional[ToolCallFormat]:
    """The tool-call format mlx-lm found for this tokenizer's chat template; None when it has none."""
    parse = getattr(tokenizer, "tool_parser", None)
    start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
    if parse is None or not start:
        return None
    name = parse.__module__.rsplit(".", 1)[-1]
    module, form = FORMATS.get(name, (whole, None))
    if module is whole:
        return ToolCallFormat(name, start, end or "", lambda tools: whole.BlockParser(tools, parse), None)
    return ToolCallFormat(name, start, end or "", module.BlockParser, form)


class ToolCallStream:
    """One answer's tool calls: blocks of tool-call text in, TextDelta and ToolCallDelta out."""

    def __init__(self, format: ToolCallFormat, tools: Optional[Sequence[dict]] = None, parallel: bool = True):
        self.format, self.tools, self.parallel = format, list(tools or []), parallel
        self.start, self.end = format.start, format.end
        self.made = 0  # calls started so far; the next call's index
        self.done = False  # not parallel and one call complete: the answer should end here
        self.block: Optional[object] = None  # the open block's parser
        self.raw = ""  # the separator before the open block and its text, content if it holds no call
        self.opened_at = 0  # where the block's text starts in raw
        self.indices: dict = {}  # the open block's call number -> global index
        self.pending = ""  # trailing whitespace of the content, held until more content follows
        self.cut: tuple = ()  # indices of the calls in the block the answer ended inside (cut short)

    @classmethod
    def for_tokenizer(cls, tokenizer, tools=None, parallel: bool = True) -> Optional["ToolCallStream"]:
        """A stream for the model's format, or None when its template has no tool calls."""
        format = tool_call_format(tokenizer)
        return None if format is None else cls(format, tools, parallel)

    def content(self, text: str) -> List[TextDelta]:
        """Answer text outside the blocks. Its trailing whitespace is held: the separator before a
        call (which the template writes again on replay) and after the last one is not content."""
        text = self.pending + text
        kept = text.rstrip()
        self.pending = text[len(kept):]
        return [TextDelta("content", kept)] if kept else []

    def open_block(self) -> None:
        self.block, self.indices = self.format.parser(self.tools), {}
        self.raw, self.pending = self.pending, ""  # the separator, given back if the block holds no call
        self.opened_at = len(self.raw)

    def feed(self, text: str) -> List[ToolCallDelta]:
        """Text inside the open block."""
        self.raw += text
        return self._deltas(self.block.feed(text))

    def close_block(self, complete: bool = True) -> list:
        """The block ended (its end marker, or the answer ended inside it when not `complete`)."""
        block, self.block = self.block, None
        try:
            out = self._deltas(block.close())
        except Exception as e:  # a parser's error on the model's text is not the request's failure
            if self.indices:  # a call already went out: what was streamed stands
                log.warning("a tool call did not parse to its end: %s", e)
                out = []
            else:
                before, inside = self.raw[:self.opened_at], self.raw[self.opened_at:]
                out = [TextDelta("content", before + self.start + inside + (self.end if complete else ""),
                                 cut=not complete)]
        if not complete:
            self.cut = tuple(sorted(self.indices.values()))
        if complete and self.indices and not self.parallel:
            self.done = True
        return out

    def finish(self) -> list:
        """End of the answer: held whitespace is content only when no call was made."""
        pending, self.pending = self.pending, ""
        return [TextDelta("content", pending)] if pending and not self.made else []

    def _deltas(self, pieces: List[CallPiece]) -> List[ToolCallDelta]:
        out = []
        for p in pieces:
            if p.call not in self.indices:  # a new call: its index, id and name
                self.indices[p.call] = self.made
                self.made += 1
                out.append(ToolCallDelta(self.indices[p.call], p.arguments, id=new_call_id(), name=p.name or ""))
            elif p.arguments:
                out.append(ToolCallDelta(self.indices[p.call], p.arguments))
        return out


def new_call_id() -> str:
    """A tool call id such as call_3f2a... (OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"
