"""`dyno launch claude|codex`: a coding agent on a local Dyno server in one command.

It starts `dyno serve` on 127.0.0.1 (a free port unless --port names one) with a fresh API key, in
a session of its own so that the terminal's Ctrl-C reaches only the client, and with its output in a
log file so that it never draws over the client's screen; or it uses a running server (--url,
--api-key). Once the server answers, the client runs with the settings it needs and the terminal,
and when it exits the server this command started is stopped; the exit status is the client's.
"""

import argparse
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import httpx

from speculative.errors import DynoError

from ..options import ModelOptions
from .common import add_model_args, notify

# The context a client needs: Claude Code's own prompt (system prompt and tool definitions) is about
# 26k tokens before the first question (docs/agents.md); Codex's instructions and tools are sent on
# every turn too, and a conversation grows from there, so both get the same 32k floor.
MIN_CONTEXT = {"claude": 32768, "codex": 32768}
INSTALL = {"claude": "Claude Code (npm install -g @anthropic-ai/claude-code)",
           "codex": "Codex CLI (npm install -g @openai/codex)"}
SERVING = re.compile(r"dyno: serving \S+ at (http://\S+)/v1 ")
ANSWER_WAIT_S = 60.0  # for a server given by --url; one this command starts is waited for while it loads
STOP_WAIT_S = 15.0


def add_command(sub) -> None:
    """Register `dyno launch` on the CLI's subparsers."""
    p = sub.add_parser("launch", help="run Claude Code or Codex CLI on a local Dyno server",
                       usage="dyno launch {claude,codex} [MODEL OPTIONS] [--port N | --url URL] [--api-key KEY] "
                             "[-- CLIENT ARGS]",
                       description="Start a Dyno server (or use one: --url), run the client on it with the "
                                   "terminal, and stop the server when the client exits; what follows `--` goes "
                                   "to the client.")
    p.add_argument("client", choices=sorted(MIN_CONTEXT), help="the agent to run: claude (Claude Code) or codex")
    add_model_args(p)
    p.add_argument("--port", type=int, default=0, help="port of the server started (default: a free one)")
    p.add_argument("--url", help="use the Dyno server at this address (e.g. http://127.0.0.1:8080) instead "
                                 "of starting one")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("DYNO_API_KEY"),
                   help="the server's key: the one --url names takes, or the one started gets (default: "
                        "$DYNO_API_KEY, else a fresh one)")
    p.set_defaults(func=cmd_launch, client_args=[])


def split_client_args(argv: List[str]) -> Tuple[List[str], Optional[List[str]]]:
    """`dyno launch ... -- ARGS`: (the arguments dyno parses, the client's, None when there is no `--`)."""
    if argv[:1] != ["launch"] or "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


@dataclass
class Server:
    """The server the client talks to: its address, key and model; `proc` when this command started it."""

    url: str
    key: Optional[str]
    proc: Optional[subprocess.Popen] = None
    log: Optional[str] = None


def cmd_launch(args) -> int:
    executable = shutil.which(args.client)
    if executable is None:
        raise DynoError(f"{args.client} is not on PATH; install {INSTALL[args.client]}")
    if not 0 <= args.port <= 65535:
        raise DynoError(f"--port must be from 0 to 65535, got {args.port}")
    if args.url is not None and not re.match(r"https?://[^/\s]+", args.url):
        raise DynoError(f"--url must be an http:// or https:// address, got {args.url!r}")
    if threading.current_thread() is threading.main_thread():  # a SIGTERM, too, stops the server first
        signal.signal(signal.SIGTERM, _interrupted)
    server = connect(args) if args.url else start(args)
    try:
        model, context = served_model(server, args.model if args.url else None)
        if context is not None and context < MIN_CONTEXT[args.client]:
            raise DynoError(f"{model} takes {context} tokens of context; {args.client} needs at least "
                            f"{MIN_CONTEXT[args.client]} (its prompt alone is most of that): serve a larger "
                            f"model, e.g. --model mlx-community/Qwen3.6-27B-4bit")
        command, env = client_command(args.client, executable, server, model, args.client_args)
        return run_client(command, env)
    finally:
        stop(server)


def _interrupted(*_):
    raise KeyboardInterrupt


def connect(args) -> Server:
    """A running server (--url), once it answers."""
    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    server = Server(url, args.api_key)
    deadline = time.monotonic() + ANSWER_WAIT_S
    while not answers(server):
        if time.monotonic() > deadline:
            raise DynoError(f"no Dyno server answers at {url} (waited {ANSWER_WAIT_S:.0f} s)")
        time.sleep(0.5)
    return server


def start(args) -> Server:
    """`dyno serve` on 127.0.0.1 with a fresh key, its output in a log file; waits until it answers."""
    if args.port and not port_free(args.port):
        raise DynoError(f"port {args.port} is in use on 127.0.0.1; leave --port out for a free one")
    key = args.api_key or secrets.token_urlsafe(24)
    log = tempfile.NamedTemporaryFile("w", prefix=f"dyno-launch-{args.client}-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "dyno_ui", "serve", *model_flags(args), "--host", "127.0.0.1",
               "--port", str(args.port), "--no-ui"]
    notify(f"dyno: starting a server for {args.client} (its log: {log.name})")
    # The key travels in the environment, not on a command line other users can read.
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, DYNO_API_KEY=key), start_new_session=True)
    log.close()
    server = Server("", key, proc, log.name)
    try:
        server.url = wait_for_url(proc, log.name)
        while not answers(server):
            if proc.poll() is not None:
                raise DynoError(f"the server stopped (see {log.name})")
            time.sleep(0.2)
    except BaseException:
        stop(server)
        raise
    return server


def model_flags(args) -> List[str]:
    """The model flags given to `dyno launch`, as `dyno serve` takes them."""
    flags = []
    for name in ("model", "speculative", "draft_depth", "draft_vocab", "mtp_head", "mtp_head_bits", "mtp_base",
                 "distributed"):
        value = getattr(args, name)
        if value != getattr(ModelOptions, name, None):
            flags += [f"--{name.replace('_', '-')}", "full" if value is None else str(value)]
    return flags


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for_url(proc: subprocess.Popen, log: str) -> str:
    """The address the server prints once it listens; while it loads, as long as it runs. A server that
    stops first had an error: its last `dyno: error:` line is this command's."""
    while True:
        with open(log, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if m := SERVING.search(text):
            return m.group(1)
        if proc.poll() is not None:
            errors = [line for line in text.splitlines() if line.startswith("dyno: error: ")]
            message = errors[-1][len("dyno: error: "):] if errors else f"the server stopped (see {log})"
            raise DynoError(message, exit_code=proc.returncode or 1)
        time.sleep(0.1)


def answers(server: Server) -> bool:
    try:
        return httpx.get(server.url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def served_model(server: Server, named: Optional[str]) -> Tuple[str, Optional[int]]:
    """(model id for the client, its context in tokens, None when the server does not say)."""
    headers = {"Authorization": f"Bearer {server.key}"} if server.key else {}
    r = httpx.get(server.url + "/v1/models", headers=headers, timeout=30)
    if r.status_code == 401:
        raise DynoError(f"{server.url} refused the key: give the server's with --api-key or DYNO_API_KEY")
    try:
        cards = r.json()["data"] if r.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        cards = None
    if not isinstance(cards, list) or not all(isinstance(c, dict) and "id" in c for c in cards):
        raise DynoError(f"{server.url}/v1/models answered {r.status_code} without a model list: not a Dyno server?")
    card = next((c for c in cards if c.get("id") == named), cards[0] if cards and named is None else None)
    if card is None:
        raise DynoError(f"{server.url} does not serve {named!r}")
    return card["id"], card.get("max_model_len")


def client_command(client: str, executable: str, server: Server, model: str,
                   extra: List[str]) -> Tuple[List[str], dict]:
    """The client's command line and environment. Claude Code reads the Anthropic variables; Codex gets
    a model provider through its `-c` overrides, so that no config file is written."""
    key = server.key or "none"  # (a server without a key takes any)
    if client == "claude":
        env = dict(os.environ, ANTHROPIC_BASE_URL=server.url, ANTHROPIC_API_KEY=key)
        return [executable, "--model", model, *extra], env
    provider = {"name": "Dyno", "base_url": server.url + "/v1", "env_key": "DYNO_API_KEY", "wire_api": "responses"}
    overrides = ['model_provider="dyno"'] + [f'model_providers.dyno.{k}="{v}"' for k, v in provider.items()]
    command = [executable] + [a for o in overrides for a in ("-c", o)] + ["--model", model, *extra]
    return command, dict(os.environ, DYNO_API_KEY=key)


def run_client(command: List[str], env: dict) -> int:
    """Run the client in the foreground; its exit status, as a shell reports it (128 + N for signal N).

    The terminal's Ctrl-C goes to the client, which decides what it means; this process waits it out
    (with a handler, not SIG_IGN: an ignored signal stays ignored in the client, a handled one does not)."""
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        try:
            proc = subprocess.Popen(command, env=env)
        except OSError as e:
            raise DynoError(f"cannot run {command[0]}: {e.strerror}") from None
        try:
            code = proc.wait()
        except BaseException:  # this command was stopped (SIGTERM): the client goes with it
            proc.terminate()
            proc.wait()
            raise
    finally:
        signal.signal(signal.SIGINT, previous)
    return 128 - code if code < 0 else code


def stop(server: Server) -> None:
    """Stop the server this command started (SIGTERM: it answers what is in flight and exits)."""
    proc = server.proc
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
