"""The FastAPI app: /health, /stats, /metrics, each API's routes, and errors in the API's envelope.

`create_app` is reusable: the playground mounts itself on the same app (at /ui). Routes only
translate; requests become engine jobs in each API's convert module, and the engine runs on the worker.
"""

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ..runtime.served import ServedModel
from .errors import MAX_BODY_BYTES, add_error_handlers
from .openai import routes as openai_routes
from .openai.schema import error_response


def create_app(served: ServedModel, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's app for `served`, whose worker is already started."""
    app = FastAPI(title="Dyno", version="0.1.0")
    app.state.served = served
    add_error_handlers(app, lambda err: error_response(err).model_dump())
    metrics = served.worker.metrics

    @app.get("/health")
    def health():
        ok = served.worker.alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": served.id},
                            status_code=200 if ok else 503)

    @app.get("/stats")
    def stats():
        memory = served.lm.head_memory  # the model served now (the Models tab can swap it)
        return {**metrics.stats_json(), "mtp_head": memory.as_json() if memory else None}

    @app.get("/metrics")
    def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    openai_routes.add_routes(app, served, max_body_bytes)
    return app
