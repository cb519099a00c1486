"""GET /v1/models and /v1/models/{id}: both APIs' SDKs ask these paths, each for its own shape.

Anthropic's SDKs send `anthropic-version` on every request; a request with it gets Anthropic's
model list (and error envelope), any other OpenAI's.
"""

import datetime
from typing import List, Optional

from fastapi import FastAPI, Query, Request

from ..runtime.errors import ApiError
from ..runtime.served import ServedModel
from .anthropic import schema as anthropic_api
from .openai import schema as openai_api

ANTHROPIC_HEADER = "anthropic-version"


def is_anthropic(request: Request) -> bool:
    return ANTHROPIC_HEADER in request.headers


def served_list(ids: List[str]) -> str:
    """'a', 'b': the ids as the other not-found messages list them."""
    return "'" + "', '".join(ids) + "'"


def _info(model_id: str, created: int) -> anthropic_api.ModelInfo:
    stamp = datetime.datetime.fromtimestamp(created, datetime.timezone.utc)
    return anthropic_api.ModelInfo(id=model_id, display_name=model_id,
                                   created_at=stamp.isoformat().replace("+00:00", "Z"))


def anthropic_page(ids: List[str], created: int, limit: int, after_id: Optional[str],
                   before_id: Optional[str]) -> anthropic_api.ModelPage:
    """Anthropic's cursor paging over `ids`: up to `limit` after `after_id`, or before `before_id`."""
    for cursor, name in ((after_id, "after_id"), (before_id, "before_id")):
        if cursor is not None and cursor not in ids:
            raise ApiError(400, f"{name}: no model '{cursor}'; this server serves {served_list(ids)}",
                           param=name)
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


def add_routes(app: FastAPI, served: ServedModel) -> None:
    @app.get("/v1/models")
    def models(request: Request, limit: int = Query(20, ge=1, le=1000), after_id: Optional[str] = None,
               before_id: Optional[str] = None):
        if is_anthropic(request):
            return anthropic_page(served.ids, served.created, limit, after_id, before_id)
        return openai_api.ModelList(data=[openai_api.ModelCard(id=i, created=served.created) for i in served.ids])

    @app.get("/v1/models/{model_id:path}")
    def model(request: Request, model_id: str):
        if model_id not in served.ids:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves "
                                f"{served_list(served.ids)}", param="model", code="model_not_found")
        if is_anthropic(request):
            return _info(model_id, served.created)
        return openai_api.ModelCard(id=model_id, created=served.created)
