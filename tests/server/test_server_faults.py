"""Faults: malformed requests get OpenAI-shaped errors, a client leaving mid-stream cancels its
generation, and the server keeps serving; the per-request log line; `dyno serve` itself."""

import logging
import re
import signal
import time

import httpx
import openai
import pytest

from helpers import tiny_models
from helpers.reference import plain_greedy
from dyno_ui import cli
from helpers.serving import MODEL_ID, detokenize, running_server
from helpers.run import dyno_server
from speculative.config import SpecConfig

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "hello"}]
BODY_LIMIT = 64 * 1024
SUMMARY = re.compile(r"^MTP: (\d+) tokens in (\d+) rounds \((\d+\.\d\d) per round\), (\d+)/(\d+) drafts accepted$")


@pytest.fixture(scope="module")
def server(tiny_dir):
    with running_server(tiny_dir(), SpecConfig("auto", 3), max_body_bytes=BODY_LIMIT) as running:
        yield running


def chat(**fields):
    return {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 4, **fields}


MALFORMED = {
    # name: (method, path, json body or raw bytes, status, param, code)
    "invalid JSON": ("POST", "/v1/chat/completions", b'{"messages": [', 400, None, None),
    "body not an object": ("POST", "/v1/chat/completions", [1, 2], 400, None, None),
    "no messages": ("POST", "/v1/chat/completions", {"model": MODEL_ID}, 400, "messages", None),
    "messages wrong type": ("POST", "/v1/chat/completions", chat(messages="hi"), 400, "messages", None),
    "unknown role": ("POST", "/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), 400,
                     "messages.0.role", None),
    "temperature wrong type": ("POST", "/v1/chat/completions", chat(temperature="hot"), 400, "temperature", None),
    "max_tokens wrong type": ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400,
                              "max_tokens", None),
    "negative max_tokens": ("POST", "/v1/chat/completions", chat(max_tokens=-5), 400, "max_tokens", None),
    "temperature out of range": ("POST", "/v1/chat/completions", chat(temperature=2.5), 400, "temperature", None),
    "top_p zero": ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    "n above 1": ("POST", "/v1/chat/completions", chat(n=2), 400, "n", "unsupported_parameter"),
    "logit_bias not a token": ("POST", "/v1/chat/completions", chat(logit_bias={"abc": 1}), 400, "logit_bias", None),
    "logit_bias out of vocab": ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400,
                                "logit_bias", None),
    "unknown model": ("POST", "/v1/chat/completions", chat(model="gpt-4"), 404, "model", "model_not_found"),
    "prompt longer than the context": ("POST", "/v1/completions", {"prompt": "x" * 5000}, 400, "prompt",
                                       "context_length_exceeded"),
    "chat longer than the context": ("POST", "/v1/chat/completions",
                                     chat(messages=[{"role": "user", "content": "y" * 5000}]), 400, "messages",
                                     "context_length_exceeded"),
    "body too large": ("POST", "/v1/completions", {"prompt": "z" * (BODY_LIMIT + 10)}, 413, None,
                       "request_too_large"),
    "unknown route": ("GET", "/v1/engines", None, 404, None, None),
    "wrong method": ("GET", "/v1/chat/completions", None, 405, None, None),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_request_gets_an_openai_error(server, name):
    method, path, body, status, param, code = MALFORMED[name]
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body} if body is not None else {}
    r = httpx.request(method, server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"] and "Traceback" not in r.text
    assert server.get("/health").status_code == 200


def test_the_openai_client_sees_typed_errors_and_the_server_keeps_serving(server, tiny_lm):
    client = server.client
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, temperature=-1)
    lm = tiny_lm()
    out = client.completions.create(model=MODEL_ID, prompt="import os\n", max_tokens=12, temperature=0)
    assert out.choices[0].text == detokenize(lm, plain_greedy(lm, lm.tokenizer.encode("import os\n"), 12))


def test_client_leaving_mid_stream_cancels_and_the_next_request_is_normal(server, tiny_lm):
    before = server.stats()
    body = {"prompt": "def main():\n", "max_tokens": 3000, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
            if i == 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while server.stats()["requests"]["cancelled"] == before["requests"]["cancelled"]:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    after = server.stats()
    assert after["requests"]["total"] - before["requests"]["total"] == 1
    assert 5 <= after["tokens"]["generated"] - before["tokens"]["generated"] < 3000
    lm = tiny_lm()
    prompt = "def main():\n"
    out = server.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=20, temperature=0)
    assert out.choices[0].text == detokenize(lm, plain_greedy(lm, lm.tokenizer.encode(prompt), 20))


def test_one_exact_log_line_per_request(server, tiny_lm, caplog):
    (a,) = tiny_lm().tokenizer.encode("A")
    with caplog.at_level(logging.INFO, logger="dyno.serve"):
        server.client.completions.create(model=MODEL_ID, prompt="x", max_tokens=21, temperature=0,
                                         logit_bias={str(a): 100})
        server.client.completions.create(model=MODEL_ID, prompt="x", max_tokens=1, temperature=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "dyno.serve"]
    assert lines[0] == "MTP: 21 tokens in 5 rounds (4.00 per round), 15/15 drafts accepted"
    assert lines[1].startswith("Plain: 1 tokens, no drafting")  # one token: no round was needed
    assert len(lines) == 2


def test_dyno_serve_command(tiny_dir, tiny_lm):
    """The real command: prints its URL, serves, logs the line, stops cleanly on Ctrl-C."""
    proc = dyno_server("--model", str(tiny_dir()), "--port", "0", "--draft-depth", "2")
    try:
        line = proc.stdout.readline()
        m = re.match(r"^dyno: serving (\S+) at (http://127\.0\.0\.1:\d+/v1) "
                     r"\(batched MTP drafting of up to 8 requests, depth 2\)$", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        (a,) = tiny_lm().tokenizer.encode("A")
        client = openai.OpenAI(base_url=m.group(2), api_key="unused", max_retries=0)
        out = client.completions.create(model=m.group(1), prompt="x", max_tokens=7, logit_bias={str(a): 100})
        assert out.choices[0].text == "A" * 7
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    # 1 prefill token + 2 rounds x (2 drafts + bonus)
    assert err.strip().splitlines()[-1].startswith("MTP: 7 tokens in 2 rounds (3.00 per round), 4/4 drafts accepted")


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    return tiny_models.build(tmp_path_factory.mktemp("nohead") / "nohead", seed=1, with_head=False)


@pytest.mark.parametrize("args, message", [
    (["--speculative", "mtp"], "no MTP head for"),
    (["--speculative", "mtp", "--decode-concurrency", "2"], "no MTP head for"),
    (["--decode-concurrency", "0"], "--decode-concurrency must be a number of requests (1 or more) or auto, got 0"),
    (["--decode-concurrency", "many"], "--decode-concurrency must be a number of requests (1 or more) or auto, got 'many'"),
    (["--reasoning-budget", "-1"], "--reasoning-budget must be 0 or more, got -1"),
])
def test_serve_refuses_what_it_cannot_do(headless, capsys, args, message):
    assert cli.main(["serve", "--model", str(headless), "--port", "0", *args]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"dyno: error: {message}") and len(err.splitlines()) == 1
    assert out == ""
