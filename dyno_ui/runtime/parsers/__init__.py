"""Tool-call parsing: the model's tool-call text as calls (id, function name, JSON arguments).

mlx-lm picks a model's tool-call format from its chat template (TokenizerWrapper.tool_parser,
tool_call_start, tool_call_end); a format's block (the text between the markers) is read by:

  json_tools   Qwen's JSON form:   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>,
               its arguments kept as the model wrote them
  whole        any other format mlx-lm knows, Qwen3.5's XML form among them
               (<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>...):
               mlx-lm's parser reads the block when it closes

Each module's BlockParser takes a block's text as it arrives and returns CallPieces (a call's
name, pieces of its arguments). Parsing the complete text is mlx-lm's own parser's job in every
module.

Any API uses it the same way (it imports nothing from the web layer):

    calls = ToolCallStream.for_tokenizer(lm.tokenizer, tools, parallel=True)  # None: no format
    text = TextAssembler(lm.tokenizer, stops, split_reasoning=True, tool_calls=calls)

The TextAssembler sends the text between the markers to `feed`, the end of a block to
`close_block` and the answer's other text to `content`; out come TextDelta and ToolCallDelta
(outputs.py). A call goes out once its block has closed and parses, whole: one ToolCallDelta
with its id, name and complete arguments. A call sent in pieces could not be taken back when
max_tokens (or a stop string) cuts its block, and an API would report half a call that a client
runs; held, a cut call is dropped, as is a block that holds no call it can parse (logged). The
call markup never becomes content. `calls.made` counts the calls sent (an API's finish reason:
"tool_calls", "tool_use"); `calls.done` says that a non-parallel request has its one call.
"""

import logging
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ..outputs import TextDelta, ToolCallDelta
from . import json_tools, whole
from .pieces import CallPiece

log = logging.getLogger("dyno.serve")

# mlx-lm's parser module -> the form speculative.constraints can force in it.
FORMS = {"json_tools": "json", "qwen3_coder": "xml"}


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
    if name == "json_tools":
        parser = json_tools.BlockParser
    else:
        parser = lambda tools: whole.BlockParser(tools, parse)  # noqa: E731
    return ToolCallFormat(name, start, end or "", parser, FORMS.get(name))


class ToolCallStream:
    """One answer's tool calls: blocks of tool-call text in, TextDelta and ToolCallDelta out."""

    def __init__(self, format: ToolCallFormat, tools: Optional[Sequence[dict]] = None, parallel: bool = True):
        self.format, self.tools, self.parallel = format, list(tools or []), parallel
        self.start, self.end = format.start, format.end
        self.made = 0  # calls sent so far; the next call's index
        self.done = False  # not parallel and one call complete: the answer should end here
        self.block: Optional[object] = None  # the open block's parser
        self.held: Dict[int, list] = {}  # the open block's calls by number: [name, argument pieces]
        self.separator = ""  # the whitespace before the open block, content again if it holds no call
        self.pending = ""  # trailing whitespace of the content, held until more content follows

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
        self.block, self.held = self.format.parser(self.tools), {}
        self.separator, self.pending = self.pending, ""

    def feed(self, text: str) -> List[ToolCallDelta]:
        """Text inside the open block: read as it comes, sent when the block closes."""
        self._hold(self.block.feed(text))
        return []

    def close_block(self, complete: bool = True) -> List[ToolCallDelta]:
        """The block ended: its end marker, or, not `complete`, the answer ended inside it (max_tokens,
        a stop string), which drops its call. Its calls go out when it parses to the end."""
        block, self.block = self.block, None
        if complete:
            try:
                self._hold(block.close())
            except Exception as e:  # a parser's error on the model's text is not the request's failure
                log.warning("a tool-call block that holds no call was dropped: %s", e)
                self.held = {}
        else:
            log.info("a tool call cut short by the end of the answer was dropped")
            self.held = {}
        held, self.held = self.held, {}
        if not held:  # no call: the whitespace before the block is the content's again
            self.pending = self.separator
            return []
        out = []
        for _, (name, pieces) in sorted(held.items()):
            out.append(ToolCallDelta(self.made, "".join(pieces), id=new_call_id(), name=name or ""))
            self.made += 1
        if not self.parallel:
            self.done = True
        return out

    def finish(self) -> list:
        """End of the answer: held whitespace is content only when no call was made."""
        pending, self.pending = self.pending, ""
        return [TextDelta("content", pending)] if pending and not self.made else []

    def _hold(self, pieces: List[CallPiece]) -> None:
        for p in pieces:
            call = self.held.setdefault(p.call, [p.name, []])
            call[1].append(p.arguments)


def new_call_id() -> str:
    """A tool call id such as call_3f2a... (OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"
