"""`dyno serve`: load the model on the engine thread, listen, print the URL, serve until stopped."""

import logging
import signal
import socket
import sys
import threading
import time
from typing import List

from speculative.config import SpecConfig
from speculative.errors import DynoError

from .models import default_model

log = logging.getLogger("dyno.serve")
DEFAULT_PORT = 8080
DEFAULT_MAX_TOKENS = 512


def add_command(sub) -> None:
    """Register `dyno serve` on the CLI's subparsers."""
    from .cli import _add_model_args

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="An OpenAI-compatible server; MTP drafting on when it is safe and exact.")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--decode-concurrency", type=int, default=1, metavar="N",
                   help="requests decoded together; above 1 they are batched without drafting (default: 1)")
    p.add_argument("--max-tokens-default", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="max_tokens for requests that do not set it (default: %(default)s)")
    p.add_argument("--no-ui", action="store_true", help="do not serve the Gradio playground at /ui")
    p.set_defaults(func=run)


def describe(worker) -> str:
    """How requests are decoded, for the startup line."""
    if worker.concurrency > 1:
        return f"batched decoding of up to {worker.concurrency} requests, no drafting"
    if worker.drafting:
        return f"MTP drafting, depth {worker.spec.draft_depth}"
    return "plain decoding, no drafting"


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


def make_app(served, ui: bool = True, ui_front: bool = False):
    """The server's app, with the playground at /ui (and / redirecting to it when `ui_front`)."""
    from .server import create_app

    app = create_app(served)
    if ui and served.worker.concurrency == 1:  # the playground drafts and swaps models: serial mode
        from fastapi.responses import RedirectResponse

        from .playground import UI_PATH, mount

        if ui_front:
            app.add_api_route("/", lambda: RedirectResponse(UI_PATH + "/"), include_in_schema=False)
        mount(app, served)
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
        from .playground import UI_PATH  # already imported by make_app: gradio is loaded

        lines.append(f"dyno: playground at {base}{UI_PATH}/")
    return lines


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


def run(args) -> int:
    """The serve command; returns the exit status."""
    import uvicorn

    from speculative.loader import load_model

    from .completions import ServedModel
    from .worker import EngineWorker

    if args.decode_concurrency < 1:
        raise DynoError(f"--decode-concurrency must be at least 1, got {args.decode_concurrency}")
    if args.max_tokens_default < 1:
        raise DynoError(f"--max-tokens-default must be at least 1, got {args.max_tokens_default}")
    if args.draft_depth != "auto":
        SpecConfig(args.speculative, args.draft_depth)  # validate before loading anything
    SpecConfig(draft_vocab=args.draft_vocab)
    from speculative.precision import parse_head_bits

    parse_head_bits(getattr(args, "mtp_head_bits", None))  # before loading anything
    batched = args.decode_concurrency > 1
    if args.speculative == "mtp" and batched:
        raise DynoError("--speculative mtp drafts one request at a time; with --decode-concurrency above 1 "
                        "requests are batched without drafts (use --speculative auto or off)")
    path = args.model or default_model()
    mode = "off" if batched else args.speculative  # batched decoding never drafts: skip the head
    notify = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731

    def load():
        from speculative.tuning import resolve_depth

        lm = load_model(path, mode=mode, mtp_head=args.mtp_head, mtp_base=getattr(args, "mtp_base", None),
                        notify=notify, head_bits=getattr(args, "mtp_head_bits", None))
        depth = resolve_depth(lm, args.draft_depth) if lm.head is not None else SpecConfig().draft_depth
        return lm, SpecConfig(mode, depth, args.draft_vocab)

    worker = EngineWorker(load, decode_concurrency=args.decode_concurrency)
    lm = worker.start()  # notices were printed while loading
    served = ServedModel(id=lm.path.name, lm=lm, worker=worker,
                         default_max_tokens=args.max_tokens_default, created=int(time.time()))
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    ui = not getattr(args, "no_ui", False) and worker.concurrency == 1
    ui_front = ui and getattr(args, "ui_front", False)
    app = make_app(served, ui=ui, ui_front=ui_front)
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
