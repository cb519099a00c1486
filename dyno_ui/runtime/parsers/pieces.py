"""What every format's BlockParser returns, and the arguments string the APIs send."""

import json
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CallPiece:
    """What a BlockParser found: the `call`-th call of its block, its name (on its first piece
    only) and a piece of its JSON arguments text."""

    call: int
    arguments: str = ""
    name: Optional[str] = None


def arguments_json(arguments) -> str:
    """A parsed call's arguments as the JSON string the APIs send (a string stays as the model wrote it)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)
