"""Qwen3.5's XML tool-call form (also Qwen3-Coder's), between <tool_call> and </tool_call>:

    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>

mlx-lm's qwen3_coder parser reads a complete block, converting each value by its parameter's
type in the tool's schema (tools in OpenAI's shape); it does not stream. Here the name goes out
once `<function=NAME>` is read, and the arguments grow one parameter at a time: each time a
`</parameter>` completes, mlx-lm's parser reads the parameters so far, and what their JSON adds
goes out (json.dumps of a dict grows by appending; the closing brace waits for the end).
"""

import json
import logging
import re
from typing import List, Optional

from mlx_lm.tool_parsers import qwen3_coder as mlx_qwen3_coder

from .pieces import CallPiece, arguments_json

log = logging.getLogger("dyno.serve")
FUNCTION = re.compile(r"<function=([^\s<>]+)>")
PARAMETER_END = "</parameter>"


class BlockParser:
    """One block's text in, its call's name and arguments out as they become known."""

    def __init__(self, tools=None):
        self.tools = list(tools or []) or None
        self.text = ""
        self.name: Optional[str] = None
        self.body_at = 0  # just past <function=NAME>
        self.read_to = 0  # just past the last </parameter> read
        self.sent = ""  # the arguments JSON that has gone out

    def feed(self, text: str) -> List[CallPiece]:
        self.text += text
        out = []
        if self.name is None:
            function = FUNCTION.search(self.text)
            if function is None:
                return []
            self.name, self.body_at = function.group(1), function.end()
            self.read_to = self.body_at
            out.append(CallPiece(0, name=self.name))
        last = self.text.rfind(PARAMETER_END)
        if last >= self.read_to:  # at least one more parameter is complete
            self.read_to = last + len(PARAMETER_END)
            params = self.text[self.body_at:self.read_to]
            try:
                call = mlx_qwen3_coder.parse_tool_call(f"<function={self.name}>{params}\n</function>", self.tools)
            except ValueError:  # a value its type cannot read (yet): the end decides
                return out
            out += self._grow(json.dumps(call["arguments"], ensure_ascii=False)[:-1])
        return out

    def _grow(self, arguments: str) -> List[CallPiece]:
        """What `arguments` adds to what went out (nothing when it does not extend it: a repeated key)."""
        if not arguments.startswith(self.sent) or arguments == self.sent:
            return []
        piece, self.sent = arguments[len(self.sent):], arguments
        return [CallPiece(0, piece)]

    def close(self) -> List[CallPiece]:
        """The block ended: the rest of the arguments; ValueError when it holds no call."""
        try:
            call = mlx_qwen3_coder.parse_tool_call(self.text, self.tools)
        except ValueError:
            if self.name is None:
                raise
            # Cut short (max_tokens) or unreadable: the parameters read so far, as a closed object.
            log.warning("tool call %r did not parse to its end", self.name)
            return [CallPiece(0, "}" if self.sent else "{}")]
        arguments = arguments_json(call["arguments"])
        if self.name is None:
            return [CallPiece(0, arguments, name=call["name"])]
        rest = self._grow(arguments)
        if not arguments.startswith(self.sent):  # a repeated key changed an earlier value
            log.warning("tool call %r: arguments changed after they were sent", self.name)
            rest = [CallPiece(0, "}")]
        return rest
