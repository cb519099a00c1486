"""`dyno launch claude|codex`, with stand-in clients: small scripts named `claude` and `codex`, first on
PATH, that record their arguments and environment, make one real request to the server they were
given, and exit as told. The server started for them answers with its fresh key and is gone once the
client exits, whether it succeeds, fails or is interrupted; a missing client, a model with too small a
context and a port in use each get one line."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dyno_ui.paths import BUNDLED_MODEL
from helpers.run import ROOT, dyno, dyno_each
from helpers.serving import running_server
from dyno_ui.options import ServeOptions
from speculative.config import SpecConfig

pytestmark = pytest.mark.e2e

# The client's request, as each client makes it: Claude Code to the Anthropic API under
# ANTHROPIC_BASE_URL, Codex to /responses under the base URL of the provider its -c overrides define.
STAND_IN = """#!{python}
import json, os, signal, sys, tomllib
import httpx

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
record = {{"argv": args, "env": {{k: os.environ.get(k) for k in ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY",
                                                               "DYNO_API_KEY")}}}}
model = args[args.index("--model") + 1]
if name == "claude":
    record["url"] = os.environ["ANTHROPIC_BASE_URL"]
    r = httpx.post(record["url"] + "/v1/messages", timeout=60, json={{"model": model, "max_tokens": 4,
                   "messages": [{{"role": "user", "content": "hi"}}]}},
                   headers={{"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"}})
else:
    overrides = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-c")
    config = {{k: tomllib.loads("v = " + v)["v"] for k, v in overrides.items()}}
    provider = "model_providers." + config["model_provider"] + "."
    base = config[provider + "base_url"]
    record["url"] = base[: -len("/v1")]
    record["wire_api"] = config[provider + "wire_api"]
    r = httpx.post(base + "/responses", timeout=60, json={{"model": model, "input": "hi", "max_output_tokens": 4}},
                   headers={{"Authorization": "Bearer " + os.environ[config[provider + "env_key"]]}})
record["status"] = r.status_code
record["keyless"] = httpx.get(record["url"] + "/v1/models", timeout=60).status_code
record["answer"] = r.json()
with open(os.environ["STAND_IN_RECORD"], "w") as f:
    json.dump(record, f)
then = os.environ.get("STAND_IN_THEN", "0")
if then == "wait":  # until a Ctrl-C, which it does not catch (nor would it come, were SIGINT ignored)
    signal.pause()
sys.exit(int(then))
"""


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """A folder holding the stand-in `claude` and `codex`."""
    folder = tmp_path_factory.mktemp("bin")
    for name in ("claude", "codex"):
        path = folder / name
        path.write_text(STAND_IN.format(python=sys.executable))
        path.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def roomy_model(tmp_path_factory):
    """dyno-tiny with a 64k context in its config (its weights take any position; the clients want room)."""
    folder = tmp_path_factory.mktemp("models") / "dyno-tiny-64k"
    shutil.copytree(BUNDLED_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 65536
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def launch(clients: Path, tmp_path: Path, *args: str, then: str = "0", path: str = None):
    """`dyno launch *args` with the stand-ins first on PATH; (its result, what the client recorded).
    A server started here has its depth pinned: `auto` would time batched rounds first (tens of seconds)."""
    if "--url" not in args:
        args = (*args[:1], "--draft-depth", "2", *args[1:])
    record = tmp_path / "record.json"
    env = dict(os.environ, PATH=path if path is not None else f"{clients}{os.pathsep}{os.environ['PATH']}",
               STAND_IN_RECORD=str(record), STAND_IN_THEN=then)
    env.pop("DYNO_API_KEY", None)
    r = dyno("launch", *args, env=env, timeout=180)
    return r, json.loads(record.read_text()) if record.exists() else None


def gone(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


def test_claude_gets_the_server_its_key_and_model(clients, roomy_model, tmp_path):
    r, seen = launch(clients, tmp_path, "claude", "--model", str(roomy_model), "--", "-p", "--verbose", "say hi")
    assert r.returncode == 0, r.stderr
    assert seen["argv"] == ["--model", "dyno-tiny-64k", "-p", "--verbose", "say hi"]
    assert seen["env"]["ANTHROPIC_BASE_URL"] == seen["url"] and seen["url"].startswith("http://127.0.0.1:")
    assert len(seen["env"]["ANTHROPIC_API_KEY"]) >= 32 and seen["keyless"] == 401  # a fresh key, required
    assert seen["status"] == 200 and seen["answer"]["type"] == "message", seen["answer"]
    assert seen["answer"]["drafting"]["mode"] == "mtp"
    assert gone(seen["url"])
    assert r.stderr.startswith("dyno: starting a server for claude (its log: "), r.stderr


def test_codex_fails_and_its_status_is_the_commands(clients, roomy_model, tmp_path):
    r, seen = launch(clients, tmp_path, "codex", "--model", str(roomy_model), then="3")
    assert r.returncode == 3, r.stderr
    assert seen["wire_api"] == "responses" and seen["env"]["DYNO_API_KEY"]
    assert seen["status"] == 200 and seen["answer"]["object"] == "response", seen["answer"]
    assert seen["argv"][-2:] == ["--model", "dyno-tiny-64k"]
    assert gone(seen["url"])


def test_ctrl_c_ends_the_client_and_then_the_server(clients, roomy_model, tmp_path):
    """A Ctrl-C at the terminal (SIGINT to its foreground process group: `dyno launch` and the client)."""
    record = tmp_path / "record.json"
    env = dict(os.environ, PATH=f"{clients}{os.pathsep}{os.environ['PATH']}", STAND_IN_RECORD=str(record),
               STAND_IN_THEN="wait")
    proc = subprocess.Popen([sys.executable, "-m", "dyno_ui", "launch", "claude", "--draft-depth", "2", "--model",
                             str(roomy_model)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not record.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the client has written its record and waits
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130, proc.stderr.read()
    finally:
        if proc.poll() is None:  # SIGTERM: it ends the client and its server, then exits
            proc.terminate()
            proc.wait(60)
    seen = json.loads(record.read_text())
    assert seen["status"] == 200 and gone(seen["url"])


def test_a_running_server_by_url_and_key(clients, roomy_model, tmp_path):
    with running_server(roomy_model, spec=SpecConfig("mtp", 3), options=ServeOptions(api_key="given-key"),
                        ) as server:
        r, seen = launch(clients, tmp_path, "codex", "--url", server.url + "/v1", "--api-key", "given-key")
        assert r.returncode == 0, r.stderr
        assert seen["status"] == 200 and seen["url"] == server.url and seen["env"]["DYNO_API_KEY"] == "given-key"
        assert seen["argv"][-2:] == ["--model", "tiny"]  # the id it serves
        assert not gone(server.url)  # not this command's to stop
        r, _ = launch(clients, tmp_path, "codex", "--url", server.url, "--api-key", "wrong")
        assert (r.returncode, r.stderr.splitlines()) == (2, [f"dyno: error: {server.url} refused the key: give "
                                                             "the server's with --api-key or DYNO_API_KEY"])


def test_one_line_each_for_a_missing_client_a_small_model_and_a_busy_port(clients, tmp_path):
    env = dict(os.environ, PATH=f"{clients}{os.pathsep}{os.environ['PATH']}")
    (missing,) = dyno_each([["launch", "codex"]], env=dict(env, PATH=str(Path(sys.executable).parent)))
    assert (missing.returncode, missing.stderr) == (2, "dyno: error: codex is not on PATH; install Codex CLI "
                                                       "(npm install -g @openai/codex)\n")
    port, url = dyno_each([["launch", "claude", "--port", "70000"], ["launch", "claude", "--url", "127.0.0.1:8080"]],
                          env=env)
    assert (port.returncode, port.stderr) == (2, "dyno: error: --port must be from 0 to 65535, got 70000\n")
    assert (url.returncode, url.stderr) == (2, "dyno: error: --url must be an http:// or https:// address, got "
                                               "'127.0.0.1:8080'\n")
    r, _ = launch(clients, tmp_path, "claude", "--model", str(tmp_path / "no-model"))  # the server's own line
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 2, r.stderr
    assert r.stderr.splitlines()[1].startswith("dyno: error: ") and "no-model" in r.stderr.splitlines()[1]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r, _ = launch(clients, tmp_path, "claude", "--port", str(port))
    assert (r.returncode, r.stderr) == (2, f"dyno: error: port {port} is in use on 127.0.0.1; leave --port out "
                                           f"for a free one\n")
    r, seen = launch(clients, tmp_path, "claude")  # the bundled dyno-tiny: a 4096-token context
    assert r.returncode == 2 and seen is None
    assert r.stderr.splitlines()[-1] == ("dyno: error: dyno-tiny takes 4096 tokens of context; claude needs at "
                                         "least 32768 (its prompt alone is most of that): serve a larger model, "
                                         "e.g. --model mlx-community/Qwen3.6-27B-4bit")
