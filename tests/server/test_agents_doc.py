"""docs/agents.md ("Using Dyno from agents and editors"), run: its `dyno serve` line configures the server
the other examples then talk to (environment variables, Python snippets, curl commands), each as written
but for the address."""

import contextlib
import io
import json
import os
import random
import re
import shlex
import tomllib
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from dyno_ui import cli
from dyno_ui.cli.serve import options_from
from dyno_ui.paths import BUNDLED_MODEL
from helpers.serving import running_server
from speculative.config import SpecConfig

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "agents.md"
TITLE = "# Using Dyno from agents and editors"
ADDRESS = "http://127.0.0.1:8080"


def section() -> str:
    """The whole page: every example on it is run here."""
    text = PAGE.read_text()
    assert text.startswith(TITLE + "\n")
    return text


def blocks(kind: str):
    """The page's fenced blocks of one language, in order."""
    return re.findall(rf"```{kind}\n(.*?)```", section(), flags=re.S)


def commands(block: str):
    """A bash block's commands (backslash continuations joined)."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_page_has_only_examples_this_file_runs():
    fences = [kind for kind, _ in re.findall(r"```(\w*)\n(.*?)```", section(), flags=re.S)]
    # "": the `dyno launch` synopsis, which tests/test_docs.py holds against the parser
    assert fences == ["", "bash", "bash", "python", "python", "python", "bash", "bash", "toml", "python"]
    assert "](docs/agents.md)" in README.read_text()  # the README's dyno serve section links here


@pytest.fixture(scope="module")
def readme_server():
    """The server the page's `dyno serve` line asks for, on dyno-tiny (the default model)."""
    serve = commands(blocks("bash")[0])
    assert len(serve) == 1
    words = shlex.split(serve[0])
    env = dict(w.split("=", 1) for w in words[: words.index("dyno")])
    args = words[words.index("dyno") + 1:]
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        options = options_from(cli.build_parser().parse_args(args))
    assert options.api_key == "my-key" and options.served_model_names == ("qwen-local",)
    assert options.allowed_origins == ("https://app.example.com",)
    with running_server(BUNDLED_MODEL, SpecConfig("auto", 3), options=options) as server:
        yield server


def test_environment_variables_configure_the_sdks(readme_server, monkeypatch):
    exports = commands(blocks("bash")[1])
    for line in exports:
        words = shlex.split(line.replace(ADDRESS, readme_server.url))
        assert words[0] == "export"
        for word in words[1:]:
            monkeypatch.setenv(*word.split("=", 1))
    model = anthropic.Anthropic(max_retries=0).messages.create(  # base URL and token from the environment
        model=os.environ["ANTHROPIC_MODEL"], max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert model.type == "message"
    reply = openai.OpenAI(max_retries=0).chat.completions.create(
        model="qwen-local", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("index", range(3))
def test_python_examples(readme_server, index):
    code = blocks("python")[index]
    assert ADDRESS in code
    out = io.StringIO()
    # The examples sample (the model's generation_config) with a seed the engine draws from Python's
    # random when a request names none: seeded here so that each run draws the same text.
    random.seed(index)
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(ADDRESS, readme_server.url), f"docs/agents.md python example {index + 1}", "exec"), {})
    printed = out.getvalue()
    assert printed.strip()
    if index == 2:  # the tool example: a call of get_weather with a city the schema allows
        first = printed.splitlines()[0]
        assert re.fullmatch(r"tool_use get_weather \{'city': '(Paris|Rome|Oslo)'\}", first), first


def test_curl_examples(readme_server):
    """Each curl command, sent as curl would send it: its URL, headers and body."""
    curls = commands(blocks("bash")[2])
    assert len(curls) == 2
    answers = []
    for line in curls:
        words = shlex.split(line.replace(ADDRESS, readme_server.url))
        assert words[0] == "curl"
        url, headers, body = None, {}, None
        rest = iter(words[1:])
        for word in rest:
            if word == "-H":
                name, _, value = next(rest).partition(":")
                headers[name.strip()] = value.strip()
            elif word == "-d":
                body = next(rest)
            else:
                assert url is None, word
                url = word
        r = httpx.post(url, headers=headers, content=body, timeout=60)  # -d makes curl POST
        assert r.status_code == 200, r.text
        answers.append(r.json())
    assert answers[0]["type"] == "message" and answers[0]["model"] == "qwen-local"
    prompt = json.loads(shlex.split(curls[1])[-1])
    assert answers[1] == {"input_tokens": answers[0]["usage"]["input_tokens"]
                          + answers[0]["usage"]["cache_read_input_tokens"]}
    assert "max_tokens" not in prompt


def test_claude_code_recipe(readme_server, monkeypatch):
    """The recipe's variables and --model, and the requests Claude Code then sends, shaped as it
    sends them: HEAD / first, then streamed /v1/messages?beta=true with its headers, system blocks and
    a system message with cache_control, tools, adaptive thinking with an effort, context_management
    and metadata; count_tokens; parallel tool_use blocks answered by tool_result blocks; a wrong key."""
    exports, claude = commands(blocks("bash")[3])
    for word in shlex.split(exports.replace(ADDRESS, readme_server.url))[1:]:
        monkeypatch.setenv(*word.split("=", 1))
    words = shlex.split(claude)
    assert words[0] == "claude" and "26k" in section() and "32k" in section()
    base, model = os.environ["ANTHROPIC_BASE_URL"], words[words.index("--model") + 1]
    headers = {"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01", "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"}
    assert httpx.head(base + "/", timeout=30).status_code == 200
    cached = {"type": "ephemeral"}
    bash = {"name": "Bash", "description": "Runs a shell command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
    ask = [{"role": "user", "content": [{"type": "text", "text": "List the files.", "cache_control": cached}]},
           {"role": "system", "content": [{"type": "text", "text": "Available agents: general-purpose."}]}]
    body = {"model": model, "max_tokens": 16, "stream": True, "tools": [bash], "messages": ask,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": cached}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "low"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "user_1_account_2_session_3"}}
    r = httpx.post(base + "/v1/messages?beta=true", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    events = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    counted = httpx.post(base + "/v1/messages/count_tokens?beta=true", headers=headers, timeout=60,
                         json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    calls = [{"type": "tool_use", "id": f"toolu_{i}", "name": "Bash", "input": {"command": c}}
             for i, c in enumerate(("ls", "pwd"))]
    results = [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": out, "cache_control": cached}
               for i, out in enumerate(("app.py", "/work"))]
    follow = dict(body, stream=False, messages=ask + [{"role": "assistant", "content": calls},
                                                      {"role": "user", "content": results}])
    r = httpx.post(base + "/v1/messages?beta=true", json=follow, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    wrong = httpx.post(base + "/v1/messages?beta=true", json=body, headers=dict(headers, **{"x-api-key": "no"}),
                       timeout=60)
    assert (wrong.status_code, wrong.headers["x-should-retry"]) == (401, "false")
    assert wrong.json()["error"]["type"] == "authentication_error"


def test_codex_config_reaches_the_responses_route(readme_server, monkeypatch):
    """The Codex provider's base URL, key variable and wire API, and a request shaped as Codex sends
    it (instructions, developer and user messages, a function tool, store false, streamed)."""
    (block,) = blocks("toml")
    config = tomllib.loads(block)
    provider = config["model_providers"][config["model_provider"]]
    assert provider["wire_api"] == "responses" and provider["base_url"] == ADDRESS + "/v1"
    monkeypatch.setenv(provider["env_key"], "my-key")
    client = openai.OpenAI(base_url=provider["base_url"].replace(ADDRESS, readme_server.url),
                           api_key=os.environ[provider["env_key"]], max_retries=0)
    shell = {"type": "function", "name": "shell", "description": "Runs a command", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                            "required": ["command"]}}
    events = list(client.responses.create(
        model=config["model"], instructions="You are a coding agent.", stream=True, store=False,
        input=[{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}],
        tools=[shell], tool_choice="auto", parallel_tool_calls=False, include=["reasoning.encrypted_content"],
        prompt_cache_key="session-1", max_output_tokens=16))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    chat = client.chat.completions.create(model=config["model"], max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert events[-1].response.model == chat.model  # the served model's id, as chat completions name it


def test_agents_sdk_example(readme_server):
    pytest.importorskip("agents")  # openai-agents is not among the test dependencies
    (code,) = blocks("python")[3:]
    out = io.StringIO()
    random.seed(0)
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(ADDRESS, readme_server.url), "docs/agents.md Agents SDK example", "exec"), {})
    assert out.getvalue().strip()
