"""The FastAPI app: /health, /stats, /metrics, each API's routes, and errors in the API's envelope.

`create_app` is reusable: the playground mounts itself on the same app (at /ui). Routes only
translate; requests become engine jobs in each API's convert module, and the engine runs on the worker.
"""

import os
from typing import Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ..options import ServeOptions
from ..runtime.served import ServedModel
from . import models
from .access import add_access
from .anthropic import routes as anthropic_routes
from .anthropic.schema import error_response as anthropic_error
from .errors import add_error_handlers
from .fields import IgnoredFields
from .openai import routes as openai_routes
from .openai.schema import error_response


def public_source(source):
    """A head's source as /stats shows it to callers without the key: a Hub repo as it is, a folder
    by its last name only (the rest of the path says where the user keeps files)."""
    if not isinstance(source, str) or not (os.path.isabs(source) or source.startswith(("~", "."))
                                           or os.sep in source and os.path.exists(source)):
        return source
    return "local folder " + os.path.basename(source.rstrip("/\\"))


def create_app(served: ServedModel, max_body_bytes: Optional[int] = None,
               options: ServeOptions = ServeOptions(), root: bool = True) -> FastAPI:
    """The server's app for `served`, whose worker is already started; `options` says who may call it
    (the key, browser origins, Host names) and the largest body (`max_body_bytes` overrides it); the
    names requests may use are `served.names`. `root`: `GET /` and `HEAD /` answer a short JSON
    (clients probe it before their first request)."""
    max_body_bytes = max_body_bytes or options.max_body_bytes
    app = FastAPI(title="Dyno", version="0.1.0")
    app.state.served = served
    app.state.ignored_fields = ignored = IgnoredFields()  # read_request notes each request's unknown fields
    anthropic_envelope = lambda err: anthropic_error(err).model_dump()  # noqa: E731
    envelope_for = add_error_handlers(app, lambda err: error_response(err).model_dump(),
                                      by_path={anthropic_routes.PREFIX: anthropic_envelope},
                                      by_header={models.PREFIX: (models.ANTHROPIC_HEADER, anthropic_envelope)})
    metrics = served.worker.metrics

    @app.get("/health")
    def health():
        ok = served.worker.alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": served.id},
                            status_code=200 if ok else 503)

    if root:
        @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
        def index():
            return {"name": "Dyno", "model": served.id, "api": "/v1"}

    @app.get("/stats")
    def stats():
        lm = served.lm  # the model served now (the Models tab can swap it)
        memory, health = lm.head_memory, lm.head_health
        head = {**memory.as_json(), "health": health.as_json() if health else None} if memory else None
        if head and options.api_key:  # open without the key: the head's source may name a local folder
            head["source"] = public_source(head.get("source"))
        return {**metrics.stats_json(), "mtp_head": head, "ignored_fields": ignored.as_json()}

    @app.get("/metrics")
    def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    models.add_routes(app, served)
    openai_routes.add_routes(app, served, max_body_bytes)
    anthropic_routes.add_routes(app, served, max_body_bytes, options.default_thinking)
    add_access(app, options.api_key, options.allowed_origins, envelope_for, options.host, options.allowed_hosts)
    return app
