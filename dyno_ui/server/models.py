"""GET /v1/models and /v1/models/{id}: both APIs' SDKs ask these paths, each for its own shape.

Anthropic's SDKs send `anthropic-version` on every request; on these paths a request with it gets
Anthropic's shapes, paging and error envelope (server/app.py), any other OpenAI's.
"""

import datetime
from typing import List, Optional

from fastapi import FastAPI, Request

from ..runtime.errors import ApiError
from ..runtime.served import ServedModel, quoted
from .anthropic import schema as anthropic_api
from .openai import schema as openai_api

ANTHROPIC_HEADER = "anthropic-version"
PREFIX = "/v1/models"  # both APIs' path


def is_anthropic(request: Request) -> bool:
    return ANTHROPIC_HEADER in request.headers


def _info(model_id: str, created: int) -> anthropic_api.ModelInfo:
    stamp = datetime.datetime.fromtimestamp(created, datetime.timezone.utc)
    return anthropic_api.ModelInfo(id=model_id, display_name=model_id,
                                   created_at=stamp.isoformat().replace("+00:00", "Z"))


def page_limit(text: Optional[str]) -> int:
    """Anthropic's `limit`: 1 to 1000, 20 when not given."""
    if text is None:
        return 20
    if not (text.isdigit() and 1 <= int(text) <= 1000):
        raise ApiError(400, f"limit: must be an integer from 1 to 1000, got {text!r}", param="limit")
    return int(text)


def anthropic_page(ids: List[str], created: int, limit: int, after_id: Optional[str],
                   before_id: Optional[str]) -> anthropic_api.ModelPage:
    """Anthropic's cursor paging over `ids`: up to `limit` after `after_id`, or before `before_id`."""
    if after_id is not None and before_id is not None:
        raise ApiError(400, "after_id and before_id cannot both be given", param="before_id")
    for cursor, name in ((after_id, "after_id"), (before_id, "before_id")):
        if cursor is not None and cursor not in ids:
            raise ApiError(400, f"{name}: no model '{cursor}'; this server serves {quoted(ids)}", param=name)
    if before_id is not None:
        end = ids.index(before_id)
        page = ids[max(0, end - limit):end]
        more = end - limit > 0
    else:
        start = ids.index(after_id) + 1 if after_id is not None else 0
        page = ids[start:start + limit]
        more = start + limit < len(ids)
    return anthropic_api.ModelPage(data=[_info(i, created) for i in page], has_more=more,
                                   first_id=page[0] if page else None, last_id=page[-1] if page else None)


def card(served: ServedModel, model_id: str) -> openai_api.ModelCard:
    """OpenAI's model object, with the context length (`dyno launch` checks it against its client's)."""
    return openai_api.ModelCard(id=model_id, created=served.created, max_model_len=served.lm.context_length)


def add_routes(app: FastAPI, served: ServedModel) -> None:
    @app.get(PREFIX)
    def models(request: Request):
        if is_anthropic(request):  # OpenAI's list takes no query: its callers' parameters are ignored
            query = request.query_params
            return anthropic_page(served.ids, served.created, page_limit(query.get("limit")),
                                  query.get("after_id"), query.get("before_id"))
        return openai_api.ModelList(data=[card(served, i) for i in served.ids])

    @app.get(PREFIX + "/{model_id:path}")
    def model(request: Request, model_id: str):
        if model_id not in served.ids:
            raise served.not_found(model_id)
        if is_anthropic(request):
            return _info(model_id, served.created)
        return card(served, model_id)
