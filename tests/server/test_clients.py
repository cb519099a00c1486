"""What real clients send, and what a web page must not do, against one real server with a key.

Fixtures shaped as Codex CLI's Responses requests, an editor plugin's chat request and an Anthropic
request with fields Dyno does not know: each is answered, streamed and not, with the greedy text of
the same request without the extra fields; the unknown ones are logged and counted in /stats. A
foreign Host (DNS rebinding) is a 403 and a body not sent as JSON a 415, on the API and on /ui; a
60 MB body is a 413 in its API's envelope and the next request is served; /stats names no folder."""

import json
import logging
import socket

import httpx
import openai
import pytest

from dyno_ui.options import ServeOptions
from dyno_ui.paths import BUNDLED_MODEL
from helpers.serving import MODEL_ID, running_server
from speculative.config import SpecConfig

pytestmark = pytest.mark.e2e

KEY = "sk-local"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "content-type": "application/json"}
READ = {"type": "function", "name": "read_file", "description": "Read a file", "strict": False,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
# Codex CLI's request, as it sends it to a `wire_api = "responses"` provider (store false, whole input).
CODEX_EXTRA = {"client_metadata": {"originator": "codex_cli_rs"}, "prompt_cache_key": "0199-session",
               "include": ["reasoning.encrypted_content"], "store": False}
CODEX = {
    "model": MODEL_ID, "instructions": "You are Codex, a coding agent.", "max_output_tokens": 6, "temperature": 0,
    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: on."}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "def add(a, b):"}]}],
    "reasoning": {"effort": "none", "summary": "auto"}, "tool_choice": "auto", "parallel_tool_calls": False,
    "tools": [{"type": "function", "name": "shell", "description": "Run a command", "strict": False,
               "parameters": {"type": "object", "properties": {"command": {"type": "array",
                                                                           "items": {"type": "string"}}}}},
              {"type": "namespace", "name": "files", "description": "An MCP server", "tools": [READ]},
              {"type": "web_search", "external_web_access": False}],
}
# The same request without what Dyno ignores: the namespace's tool as the model sees it, no hosted tool.
CODEX_PLAIN = {**CODEX, "tools": [CODEX["tools"][0], {**READ, "name": "files__read_file"}]}
EDITOR_EXTRA = {"user": "editor-user-1", "prompt_cache_key": "buffer-7", "safety_identifier": "u1",
                "editor_session": {"id": 3}}
EDITOR = {"model": MODEL_ID, "messages": [{"role": "system", "content": "Complete the code."},
                                          {"role": "user", "content": "def add(a, b):"}],
          "max_tokens": 6, "temperature": 0, "parallel_tool_calls": False, "response_format": {"type": "text"}}
THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}  # the answer within a few tokens
ANTHROPIC_BODY = {"model": MODEL_ID, "max_tokens": 6, "temperature": 0, "thinking": {"type": "disabled"},
                  "messages": [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]}
ANTHROPIC = {**{k: v for k, v in ANTHROPIC_BODY.items() if k != "temperature"}, "extra_body": {"temperature": 0}}
ANTHROPIC_EXTRA_BLOCK = {"cache_control": {"type": "ephemeral"}, "citations": None}


@pytest.fixture(scope="module")
def server():
    with running_server(BUNDLED_MODEL, SpecConfig("mtp", 3), options=ServeOptions(api_key=KEY)) as running:
        yield running


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_codex_request_is_answered_as_without_its_extra_fields(server, caplog):
    c = client(server)
    plain = c.responses.create(**CODEX_PLAIN)
    with caplog.at_level(logging.INFO, logger="dyno.serve"):
        whole = c.responses.create(**CODEX, extra_body=CODEX_EXTRA)
        streamed = list(c.responses.create(**CODEX, stream=True, extra_body=CODEX_EXTRA))
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert plain.output_text and whole.output_text == text == plain.output_text
    assert streamed[-1].response.output_text == plain.output_text
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("dyno: /v1/responses: ignored unknown fields: client_metadata") == 2, lines
    assert lines.count("dyno: /v1/responses: left out hosted tools this server cannot run: web_search") == 2


def test_a_namespace_tools_call_comes_back_named_as_the_request_named_it(server):
    c = client(server)
    forced = {**CODEX, "max_output_tokens": 40, "tool_choice": {"type": "function", "name": "read_file",
                                                                "namespace": "files"}}
    out = c.responses.create(**forced)
    call = next(item for item in out.output if item.type == "function_call")
    assert (call.namespace, call.name) == ("files", "read_file"), out.output
    assert "path" in json.loads(call.arguments)
    streamed = list(c.responses.create(**forced, stream=True))
    added = [e.item for e in streamed if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [(i.namespace, i.name) for i in added] == [("files", "read_file")]
    # Codex sends the call back with its namespace, and the result: the next turn is answered.
    history = CODEX["input"] + [{"type": "function_call", "call_id": call.call_id, "namespace": "files",
                                 "name": "read_file", "arguments": call.arguments},
                                {"type": "function_call_output", "call_id": call.call_id, "output": "x = 1"}]
    assert c.responses.create(**{**CODEX, "input": history}).status in ("completed", "incomplete")


def test_a_forced_hosted_tool_is_a_400_that_says_so(server):
    r = server.post("/v1/responses", headers=JSON, json={**CODEX, "tool_choice": {"type": "web_search"}})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "tool_choice: the hosted tool 'web_search' runs on OpenAI's side; this server cannot run it "
        "(offer a function tool instead)")


def test_editor_chat_request_is_answered_as_without_its_extra_fields(server):
    c = client(server)
    plain = c.chat.completions.create(**EDITOR, extra_body=THINK_OFF).choices[0].message.content
    whole = c.chat.completions.create(**EDITOR, extra_body={**EDITOR_EXTRA, **THINK_OFF})
    chunks = list(c.chat.completions.create(**EDITOR, stream=True, stream_options={"include_usage": True},
                                            extra_body={**EDITOR_EXTRA, **THINK_OFF}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert plain and whole.choices[0].message.content == text == plain
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert server.stats()["ignored_fields"]["by_field"]["editor_session"] >= 2


def test_anthropic_request_with_unknown_fields_is_answered_as_without(server):
    a = server.anthropic(KEY)
    plain = a.messages.create(**ANTHROPIC).content[0].text
    messages = [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):", **ANTHROPIC_EXTRA_BLOCK}]}]
    extra = {"extra_body": {"temperature": 0, "context_management": {"edits": []}}, "messages": messages}
    whole = a.messages.create(**{**ANTHROPIC, **extra})
    with a.messages.stream(**{**ANTHROPIC, **extra}) as stream:
        text = "".join(stream.text_stream)
    assert plain and whole.content[0].text == text == plain
    counted = a.messages.count_tokens(model=MODEL_ID, messages=messages, extra_body={"context_management": {}})
    assert counted.input_tokens == a.messages.count_tokens(model=MODEL_ID, messages=ANTHROPIC["messages"]).input_tokens
    by_field = server.stats()["ignored_fields"]["by_field"]
    assert by_field["messages.*.content.*.citations"] >= 3 and by_field["context_management"] >= 3
    assert not any("cache_control" in name for name in by_field)  # known, and of no use here


def port(server) -> str:
    return server.url.rsplit(":", 1)[1]


@pytest.mark.parametrize("path, anthropic", [("/v1/chat/completions", False), ("/v1/messages", True),
                                             ("/ui/gradio_api/queue/join", False)])
def test_a_rebound_host_and_a_plain_text_post_are_refused(server, path, anthropic):
    body = json.dumps(ANTHROPIC_BODY if anthropic else EDITOR)
    rebound = server.post(path, headers={**JSON, "host": f"evil.example:{port(server)}"}, content=body)
    page = server.post(path, headers={**AUTH, "content-type": "text/plain"}, content=body)
    for r, status in ((rebound, 403), (page, 415)):
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["type"] == {403: "permission_error", 415: "invalid_request_error"}[status]
        assert ("code" in error) != anthropic  # each API's envelope
    assert rebound.json()["error"]["message"] == ("Host 'evil.example' names no address of this server; to "
                                                  "serve it, start the server with --allowed-hosts evil.example")
    assert server.get("/ui/", headers={"host": "evil.example"}).status_code == 403
    local = server.get("/v1/models", headers={**AUTH, "host": f"localhost:{port(server)}"})
    assert local.status_code == 200


def test_hosts_allowed():
    from dyno_ui.server.access import host_allowed, host_name

    assert [host_name(h) for h in ("Evil.Example:80", "[::1]:8080", "localhost.", "127.0.0.1")] == [
        "evil.example", "::1", "localhost", "127.0.0.1"]
    assert all(host_allowed(h, "127.0.0.1", ()) for h in ("localhost", "app.localhost", "127.0.0.2", "::1"))
    assert not any(host_allowed(h, "127.0.0.1", ()) for h in ("evil.example", "192.168.1.2", "", "localhost.evil"))
    assert host_allowed("192.168.1.2", "0.0.0.0", ()) and not host_allowed("evil.example", "0.0.0.0", ())
    assert host_allowed("dyno.lan", "127.0.0.1", ("dyno.lan",)) and host_allowed("a.b.lan", "::", (".b.lan",))
    assert host_allowed("anything", "127.0.0.1", ("*",))


def raw_post(url: str, path: str, body: bytes, chunked: bool) -> bytes:
    """The whole reply to a POST written to the socket the plain way, every byte sent before any is
    read, as simple clients do (httpx reads an early answer even when the server stopped reading)."""
    host, port_ = url[len("http://"):].split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port_}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nConnection: close\r\n")
    if chunked:
        size = 1 << 20
        body = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                        for i in range(0, len(body), size)) + b"0\r\n\r\n"
        head += "Transfer-Encoding: chunked\r\n\r\n"
    else:
        head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port_)), timeout=60) as sock:
        sock.sendall(head.encode() + body)
        reply = b""
        while chunk := sock.recv(1 << 16):
            reply += chunk
    return reply


@pytest.mark.parametrize("path, body, chunked", [("/v1/chat/completions", EDITOR, False),
                                                  ("/v1/messages", ANTHROPIC_BODY, True)])
def test_a_60_mb_body_is_a_413_and_the_next_request_is_served(server, path, body, chunked):
    """Sized (Content-Length: refused before any is read) or chunked (refused past the limit)."""
    big = json.dumps({**body, "padding": "x" * (60 * 1024 * 1024)}).encode()
    reply = raw_post(server.url, path, big, chunked)
    status, _, rest = reply.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large", reply[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["message"] == f"The request body is larger than {32 * 1024 * 1024} bytes"
    assert ("code" in error) == (path != "/v1/messages")  # each API's envelope
    assert server.post(path, headers=JSON, json=body).status_code == 200


def test_stats_and_metrics_stay_open_and_name_no_folder(server):
    folder = server.served.lm.head_memory.source  # what /stats showed before, with a key as without
    assert folder.startswith("/")
    stats, metrics = server.get("/stats"), server.get("/metrics")
    assert stats.status_code == metrics.status_code == 200
    assert folder not in stats.text and folder not in metrics.text
    assert stats.json()["mtp_head"]["source"] == "local folder " + folder.rstrip("/").rsplit("/", 1)[-1]


def test_a_flood_of_unknown_fields_is_counted_in_bounded_memory(server, caplog):
    from dyno_ui.server.fields import MAX_LOGGED, MAX_PATHS, OTHER

    flood = {f"field_{i}": i for i in range(MAX_PATHS + 50)} | {"x" * 10_000: 1}
    before = server.stats()["ignored_fields"]["total"]
    with caplog.at_level(logging.INFO, logger="dyno.serve"):
        r = server.post("/v1/chat/completions", headers=JSON, json={**EDITOR, "max_tokens": 1, **flood})
    assert r.status_code == 200, r.text
    ignored = server.stats()["ignored_fields"]
    assert ignored["total"] == before + len(flood)
    assert len(ignored["by_field"]) <= MAX_PATHS + 1 and ignored["by_field"][OTHER] >= 1
    assert max(map(len, ignored["by_field"])) <= 120
    line = next(r.getMessage() for r in caplog.records if "ignored unknown fields" in r.getMessage())
    assert line.endswith(f" and {len(flood) - MAX_LOGGED} more") and len(line) < 2_000
    assert client(server).chat.completions.create(**EDITOR, extra_body=THINK_OFF).choices[0].message.content


def test_another_sites_page_cannot_upload_to_the_playground(server):
    """A form upload needs no CORS preflight: the Origin a browser sends decides."""
    files = {"files": ("a.txt", b"x" * 1000, "text/plain")}
    here = f"http://127.0.0.1:{port(server)}"
    other = server.post("/ui/gradio_api/upload", headers={"origin": "http://evil.example"}, files=files)
    assert other.status_code == 403 and other.json()["error"]["message"] == (
        "A page of http://evil.example cannot drive this server's playground; to let it, start the server "
        "with --allowed-origins http://evil.example")
    assert server.post("/ui/gradio_api/upload", headers={"origin": "null"}, files=files).status_code == 403
    for headers in ({"origin": here}, {}):  # the playground's own page, and a client that is no browser
        assert server.post("/ui/gradio_api/upload", headers=headers, files=files).status_code != 403
