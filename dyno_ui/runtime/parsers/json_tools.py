"""Qwen's JSON tool-call form: `{"name": ..., "arguments": {...}}` between <tool_call> and </tool_call>.

mlx-lm's json_tools parser reads a complete block (json.loads), which re-serialised would not
always be the text the model wrote (spacing, escapes, number spellings). Here the arguments
object is kept as written: once `{"name": "...", "arguments": ` has been read, a small scanner
follows strings and nesting to its closing brace, and the pieces up to it are the arguments. A
block of another shape (other key order, arguments that are not an object) is read whole by
mlx-lm's parser when it closes.
"""

import json
import re
from typing import List, Optional

from mlx_lm.tool_parsers import json_tools as mlx_json_tools

from .pieces import CallPiece, arguments_json

# The call's opening up to the first character of its arguments value (the name a complete JSON string).
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


class BlockParser:
    """One block's text in, its call's name and arguments out as they become known."""

    def __init__(self, tools=None):
        self.text = ""
        self.name: Optional[str] = None
        self.arguments_at: Optional[int] = None  # where the arguments object starts, when streamed
        self.arguments_end: Optional[int] = None  # just past its closing brace, once read
        self.sent = 0  # text[arguments_at:sent] has gone out
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> List[CallPiece]:
        self.text += text
        out = []
        if self.name is None:
            header = HEADER.match(self.text)
            try:
                self.name = json.loads(header.group(1)) if header else None
            except ValueError:  # not a valid JSON string (a bad escape): read whole when the block closes
                pass
            if self.name is None:
                return []
            out.append(CallPiece(0, name=self.name))
            if self.text[header.end()] in "{[":
                self.arguments_at = self.sent = header.end()
        if self.arguments_at is not None and self.arguments_end is None:
            upto = self._scan()
            if upto > self.sent:
                out.append(CallPiece(0, self.text[self.sent:upto]))
                self.sent = upto
        return out

    def _scan(self) -> int:
        """Read the arguments from where the scan stopped; how far they go (to the closing brace, once read)."""
        for i in range(self.sent, len(self.text)):
            c = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.arguments_end = i + 1
                    return i + 1
        return len(self.text)

    def close(self) -> List[CallPiece]:
        """The block ended: what has not been read out yet; ValueError unless the whole block is
        one call object (so the arguments read as written are valid JSON)."""
        call = mlx_json_tools.parse_tool_call(self.text)  # json.loads: ValueError on anything else
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("not a tool call object")
        if self.arguments_end is not None:
            return []
        arguments = arguments_json(call.get("arguments"))
        if self.name is not None:  # the name went out; the arguments were not an object
            return [CallPiece(0, arguments)]
        return [CallPiece(0, arguments, name=call["name"])]
