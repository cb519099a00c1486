"""The drafting figures on the wire: one field, `drafting`, on every API's answer, whole or streamed
(runtime/figures.py builds its value); left out of the chunks and events that do not carry it."""

from typing import Any, Dict, Literal, Optional

from pydantic import BaseModel, model_serializer

from speculative.config import COPY_SOURCES

# A request's `copies` field on every API: its draft sources (copies beside the head's, the head alone,
# copies alone; speculative/round/copies.py); null or absent: the server's --copies. Anything else is a 400.
Copies = Optional[Literal[COPY_SOURCES]]


class Drafted(BaseModel):
    """A response, or a stream's last chunk or event, with what drafting did for the request."""

    drafting: Optional[Dict[str, Any]] = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler):
        out = handler(self)
        if out.get("drafting") is None:
            out.pop("drafting", None)
        return out
