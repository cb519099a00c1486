"""Any other tool-call format mlx-lm knows (Mistral's, GLM's, Kimi's, ...): its own parser reads
each block when the block closes, and the calls go out whole, name and complete arguments in one
piece. Streaming them piece by piece would take a parser per format; Qwen3.5-family models use
the two formats that have one (json_tools, qwen3_coder)."""

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
