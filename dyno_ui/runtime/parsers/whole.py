"""Any tool-call format but Qwen's JSON form (Qwen3.5's XML form, Mistral's, GLM's, Kimi's, ...):
mlx-lm's own parser for it reads each block when the block closes (for the XML form, converting
each value by its parameter's type in the tool's schema), name and complete arguments in one piece."""

from typing import Callable, List

from .pieces import CallPiece, arguments_json


class BlockParser:
    """One block's text in; its calls out when it closes."""

    def __init__(self, tools, parse: Callable):
        self.tools, self.parse, self.text = list(tools or []) or None, parse, ""

    def feed(self, text: str) -> List[CallPiece]:
        self.text += text
        return []

    def close(self) -> List[CallPiece]:
        calls = self.parse(self.text, self.tools)
        calls = calls if isinstance(calls, list) else [calls]
        if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            raise ValueError("no tool call")
        return [CallPiece(i, arguments_json(c.get("arguments")), name=c["name"]) for i, c in enumerate(calls)]
