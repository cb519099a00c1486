"""Serving: load the model on the engine thread, listen, print the URL, serve until stopped."""

import logging
import signal
import socket
import sys
import threading
import time
from typing import List

from speculative.errors import DynoError
from speculative.loader.vision import ImageLimits

from ..options import ServeOptions
from ..runtime.images import ImagePolicy
from ..paths import default_model

log = logging.getLogger("dyno.serve")


def describe(worker) -> str:
    """How requests are decoded, for the startup line."""
    if worker.concurrency > 1 and worker.drafting:
        policy = worker.policy
        depth = (f"depth {policy.pinned}" if policy.pinned is not None
                 else f"depth 0-{policy.deepest} chosen each round by measured cost")
        return f"batched MTP drafting of up to {worker.concurrency} requests, {depth}"
    if worker.concurrency > 1:
        return f"batched decoding of up to {worker.concurrency} requests, no drafting"
    ranks = worker.lm.ranks if worker.lm is not None else None
    split = f", {ranks.strategy} across {ranks.size} ranks" if ranks is not None else ""
    if worker.drafting:
        return f"MTP drafting, depth {worker.spec.draft_depth}{split}"
    return f"plain decoding, no drafting{split}"


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DynoError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def make_app(served, ui: bool = True, ui_front: bool = False, options: ServeOptions = ServeOptions()):
    """The server's app, with the playground at /ui (and / redirecting to it when `ui_front`)."""
    from .app import create_app

    app = create_app(served, options=options, root=not (ui and ui_front))  # else / opens the playground
    if ui:
        from fastapi.responses import RedirectResponse

        from ..playground.ui import UI_PATH, mount

        if ui_front:
            app.add_api_route("/", lambda: RedirectResponse(UI_PATH + "/"), methods=["GET", "HEAD"],
                              include_in_schema=False)
        mount(app, served, api_key=options.api_key)
    return app


def startup_lines(model_id: str, how: str, base: str, ui: bool, ui_front: bool) -> List[str]:
    """What `run` prints once listening: the API base first, the playground (when served) last.

    `python app.py` (`ui_front`) ends with Gradio's own line, the one people know to open; `dyno serve`
    is an API server first, so its first line stays the API's.
    """
    lines = [f"dyno: serving {model_id} at {base}/v1 ({how})"]
    if ui and ui_front:
        lines.append(f"* Running on local URL:  {base}")
    elif ui:
        from ..playground.ui import UI_PATH  # already imported by make_app: gradio is loaded

        lines.append(f"dyno: playground at {base}{UI_PATH}/")
    return lines


def open_warning(host: str, api_key) -> List[str]:
    """One line when the server can be reached from other machines and asks for no key."""
    from .access import is_loopback

    if api_key or is_loopback(host):
        return []
    return [f"dyno: warning: listening on {host} without --api-key: anyone who can reach this port can use "
            f"the model (set --api-key or DYNO_API_KEY)"]


def server_for(config, worker):
    """uvicorn's server, told to stop the engine as soon as it starts shutting down: queued requests
    then get their 503 and generations end at their next round, within the grace period, instead
    of having their connections dropped when it runs out."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            worker.begin_close()
            await super().shutdown(sockets)

    return Server(config)


def _stop(*_):
    raise KeyboardInterrupt


def run(options: ServeOptions) -> int:
    """Serve until stopped; returns the exit status."""
    import uvicorn

    from speculative import distributed, load_model

    from ..runtime.served import ServedModel
    from ..runtime.worker import EngineWorker

    m = options.model
    path = m.model or default_model()
    notify = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    split = distributed.Member(m.distributed) if m.distributed else None
    if split is not None and not split.leader:
        if threading.current_thread() is threading.main_thread():
            # Ctrl-C reaches every rank; rank 0 shuts down and releases this one. Interrupted itself,
            # a follower exited 130 once released, and mlx.launch then sent rank 0 a SIGTERM while it
            # was still shutting down (a traceback from rank 0; likely why a group once never ended).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:  # this rank serves nothing: it runs rank 0's rounds until released
            distributed.follow(load_model(path, **m.load_args(), split=split)[0])
            return 0
        finally:
            split.close()

    def load():
        return load_model(path, **m.load_args(), draft_depth=m.draft_depth, draft_vocab=m.draft_vocab,
                          notify=notify, split=split, batched=options.width > 1)

    # Split across ranks: no prompt cache (each rank's store would evict by its own shard's bytes).
    worker = EngineWorker(load, decode_concurrency=options.width,
                          prompt_cache_bytes=0 if split else options.prompt_cache_bytes,
                          prompt_cache_dir=None if split else options.prompt_cache_dir,
                          prompt_cache_disk_bytes=options.prompt_cache_disk_bytes, max_queue=options.max_queue,
                          max_batch_memory=options.max_batch_memory)
    lm = worker.start()  # notices were printed while loading
    served = ServedModel(id=lm.name, lm=lm, worker=worker, default_max_tokens=options.max_tokens_default,
                         created=int(time.time()), names=options.served_model_names,
                         reasoning_budget=options.reasoning_budget, images=image_policy(options))
    sock = listen(options.host, options.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    ui = options.ui and split is None  # its Models tab would swap one rank's model
    ui_front = ui and options.ui_front
    app = make_app(served, ui=ui, ui_front=ui_front, options=options)
    for line in open_warning(options.host, options.api_key):
        print(line, file=sys.stderr, flush=True)
    for line in startup_lines(served.id, describe(worker), f"http://{shown}:{port}", ui, ui_front):
        print(line, flush=True)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))  # the per-request line, exactly
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    # Gradio starts its queue in the app's lifespan; the API alone needs none.
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on" if ui else "off",
                            timeout_graceful_shutdown=10)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)  # uvicorn re-raises it after shutting down
    try:
        server_for(config, worker).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C (or SIGTERM) it shut down on
        pass
    finally:
        worker.close(timeout=5)
    return 0


def image_policy(options: ServeOptions) -> ImagePolicy:
    """The server's image limits and whether it fetches image URLs (--allow-image-urls, --max-image-*)."""
    return ImagePolicy(ImageLimits(options.max_images, options.max_image_bytes, options.max_image_pixels),
                       fetch_urls=options.allow_image_urls)
