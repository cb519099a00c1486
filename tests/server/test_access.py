"""Who may call the server: --api-key on every /v1 route of both APIs (401 in the caller's shape),
CORS for the origins --allowed-origins names, the ids --served-model-name adds, and the flags."""

import anthropic
import httpx
import openai
import pytest

from dyno_ui import cli
from dyno_ui.cli.serve import options_from
from dyno_ui.options import ServeOptions
from dyno_ui.playground.sessions import Sessions
from dyno_ui.server.run import open_warning
from helpers.serving import MODEL_ID, running_server
from speculative.config import SpecConfig
from speculative.errors import DynoError

pytestmark = pytest.mark.e2e

KEY = "sk-dyno-test"
ALLOWED = "https://editor.example"
OPTIONS = ServeOptions(api_key=KEY, allowed_origins=(ALLOWED,), served_model_names=("qwen-local", "claude-local"))
CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
MESSAGES = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(tiny_dir):
    with running_server(tiny_dir(), SpecConfig("auto", 2), options=OPTIONS) as running:
        yield running


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}), ("POST", "/v1/nowhere", {}),
    ("POST", "/v1/responses", {"model": MODEL_ID, "input": "hi"}),
])
def test_openai_routes_need_the_key(server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.headers["x-should-retry"] == "false"  # agent clients retry a 401 unless told not to
        assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()) == {"error"}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/messages?beta=true"])
def test_anthropic_routes_need_the_key(server, path):
    r = server.post(path, json=MESSAGES, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.headers["x-should-retry"] == "false"
    assert r.json() == {"type": "error", "error": {"type": "authentication_error", "message": r.json()["error"][
        "message"]}}


def test_either_header_opens_both_apis_and_health_stays_open(server):
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"authorization": f"bearer {KEY}"}):
        assert server.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
        assert server.post("/v1/messages", json=MESSAGES, headers=headers).status_code == 200
    assert server.get("/health").json()["status"] == "ok"
    assert server.get("/stats").status_code == 200 and server.get("/metrics").status_code == 200  # by design


def test_official_clients_with_and_without_the_key(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(**CHAT).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        server.client.chat.completions.create(**CHAT)  # its key is "unused"
    assert server.anthropic(KEY).messages.create(**MESSAGES).stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.AuthenticationError) as e:
        server.anthropic("wrong").messages.create(**MESSAGES)
    assert e.value.body["error"]["type"] == "authentication_error"


def preflight(server, origin, path="/v1/chat/completions"):
    return httpx.options(server.url + path, timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


def test_cors_preflight_from_an_allowed_origin_only(server):
    ok = preflight(server, ALLOWED)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert preflight(server, ALLOWED, "/v1/messages").headers["access-control-allow-origin"] == ALLOWED
    refused = preflight(server, "https://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # A browser can read the answers (the 401 too) from the allowed origin, and nothing from another.
    r = server.post("/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED, "x-api-key": KEY})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    r = server.post("/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ALLOWED
    r = server.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example", "x-api-key": KEY})
    assert "access-control-allow-origin" not in r.headers


def test_no_key_and_no_origins_by_default(tiny_dir):
    with running_server(tiny_dir(), SpecConfig("auto", 2)) as server:
        assert server.post("/v1/chat/completions", json=CHAT).status_code == 200
        r = preflight(server, ALLOWED)
        assert "access-control-allow-origin" not in r.headers
        r = server.post("/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_served_model_names(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.chat.completions.create(**dict(CHAT, model="qwen-local")).choices
    message = server.anthropic(KEY).messages.create(**dict(MESSAGES, model="claude-local"))
    assert message.model == "claude-local"
    with pytest.raises(anthropic.NotFoundError) as e:
        server.anthropic(KEY).messages.create(**dict(MESSAGES, model="claude-opus-4"))
    assert "'tiny', 'qwen-local', 'claude-local'" in e.value.body["error"]["message"]
    assert server.served.ids == [MODEL_ID, "qwen-local", "claude-local"]
    assert [m.id for m in client.models.list().data] == [MODEL_ID, "qwen-local", "claude-local"]
    assert client.models.retrieve("qwen-local").id == "qwen-local"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    # Anthropic's client pages with a cursor: one id per page here walks all three, in order.
    pages = server.anthropic(KEY).models.list(limit=1)
    assert [m.id for m in pages] == [MODEL_ID, "qwen-local", "claude-local"]
    first = server.anthropic(KEY).models.list(limit=2)
    assert (first.has_more, first.first_id, first.last_id) == (True, MODEL_ID, "qwen-local")
    back = server.anthropic(KEY).models.list(limit=5, before_id="claude-local")
    assert [m.id for m in back.data] == [MODEL_ID, "qwen-local"] and not back.has_more


def test_anthropic_clients_get_their_401_on_the_shared_models_route(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        server.anthropic("wrong").models.list()
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    assert e.value.response.headers["x-should-retry"] == "false"


def test_playground_model_loading_needs_the_key(server):
    sessions = Sessions(server.served, api_key=KEY)
    for key in (None, "", "wrong"):
        with pytest.raises(DynoError, match="API key"):
            sessions.load("/nowhere", print, key=key)
        with pytest.raises(DynoError, match="API key"):
            sessions.fetch_head("/nowhere", print, key=key)
    assert server.served.loading is None  # refused before anything was queued
    Sessions(server.served).authorize(None)  # a server without a key asks for none
    sessions.authorize(KEY)


def test_flags_become_options(monkeypatch):
    parse = cli.build_parser().parse_args
    options = options_from(parse(["serve", "--api-key", "k1", "--allowed-origins", "http://a.test,https://b.test/",
                                  "--allowed-origins", "*", "--served-model-name", "m1", "--served-model-name", "m2"]))
    assert (options.api_key, options.allowed_origins, options.served_model_names) == (
        "k1", ("http://a.test", "https://b.test", "*"), ("m1", "m2"))
    monkeypatch.setenv("DYNO_API_KEY", "from-env")
    assert options_from(cli.build_parser().parse_args(["serve"])).api_key == "from-env"
    monkeypatch.delenv("DYNO_API_KEY")
    assert options_from(cli.build_parser().parse_args(["serve"])).api_key is None
    with pytest.raises(DynoError, match="allowed-origins"):
        ServeOptions(allowed_origins=("editor.example",))
    with pytest.raises(DynoError, match="api-key"):
        ServeOptions(api_key=" ")
    local = options_from(parse(["serve", "--allowed-hosts", "dyno.lan, .home.arpa", "--max-body-bytes", "64MiB"]))
    assert (local.allowed_hosts, local.max_body_bytes) == (("dyno.lan", ".home.arpa"), 64 * 2**20)
    assert options.max_body_bytes == 32 * 2**20
    with pytest.raises(DynoError, match="--max-body-bytes must be a number of bytes"):
        ServeOptions(max_body_bytes="lots")
    with pytest.raises(DynoError, match="--allowed-hosts takes host names"):
        ServeOptions(allowed_hosts=("http://dyno.lan",))


@pytest.mark.parametrize("host, key, warned", [
    ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False), ("0.0.0.0", "k", False),
    ("0.0.0.0", None, True), ("192.168.1.5", None, True), ("::", None, True), ("myhost", None, True),
])
def test_listening_beyond_loopback_without_a_key_warns(host, key, warned):
    lines = open_warning(host, key)
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert lines[0].startswith("dyno: warning:") and "--api-key" in lines[0] and host in lines[0]
