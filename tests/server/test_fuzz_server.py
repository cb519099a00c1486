"""Property-based fuzzing of the real server: random and boundary values for every field of
/v1/chat/completions, /v1/completions and /v1/responses, serial and batched, each sent while a
well-formed request runs beside it, with hostile Host and Content-Type headers among them (a foreign
Host is a 403, a body not sent as JSON a 415). Pass: no 5xx, no hang, /health 200, every well-formed
answer exactly right."""

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers.reference import plain_greedy
from helpers.serving import MODEL_ID, detokenize, running_server
from speculative.config import SpecConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONTEXT = 160  # a short context keeps every fuzzed max_tokens cheap
EXAMPLES = 80  # per mode; about half a second each on 2 CPU cores
CHECK_PROMPT = "def check(x):"
VOCAB = 320  # tests/helpers/tiny_models.py

INTS = st.sampled_from([-(2**70), -(2**63), -1, 0, 1, 2, 3, VOCAB - 1, VOCAB, VOCAB + 1, CONTEXT, 2**31,
                        2**63, 2**64, 2**64 + 1, 10**30]) | st.integers(-50, 400)
FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-300, 1e300, 0.5, 1.0, 2.0, 2.0000001,
                          -2.0, 100.0, -100.0, 100.5]) | st.floats(-3, 3)
JUNK = st.sampled_from([None, True, False, "", "x", "1", [], {}, [1, "a"], {"a": 1}, "\u0000", "\ud7ff" * 3])
COPIES = st.sampled_from(["on", "off", "only"]) | JUNK | INTS  # a request's draft sources
ANY = INTS | FLOATS | JUNK
TEXT = st.text(max_size=40) | st.sampled_from(["<|im_end|>", "<think>", "</think>", "\n\n", "é" * 30])
STOP = TEXT | st.lists(TEXT, max_size=5) | JUNK
CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3) | JUNK
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]) | JUNK},
    optional={"content": CONTENT, "reasoning_content": TEXT | JUNK, "name": TEXT},
)
SHARED = {
    "model": st.just(MODEL_ID) | TEXT | JUNK,
    "max_tokens": INTS | JUNK,
    "temperature": FLOATS | INTS | JUNK,
    "top_p": FLOATS | INTS | JUNK,
    "top_k": INTS | JUNK,
    "min_p": FLOATS | JUNK,
    "seed": INTS | FLOATS | JUNK,
    "n": INTS | JUNK,
    "stop": STOP,
    "stream": st.booleans() | JUNK,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JUNK}) | JUNK,
    "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "319", "320", "-1", "abc", " 5", "1e3", "²", "٣"])
                                  | st.text(max_size=4), FLOATS | INTS | JUNK, max_size=4) | JUNK,
    "presence_penalty": FLOATS | JUNK,
    "frequency_penalty": FLOATS | JUNK,
    "repetition_penalty": FLOATS | JUNK,
    "repetition_context_size": INTS | JUNK,
    "draft": st.booleans() | JUNK,
    "copies": COPIES,
    "unknown_field": ANY,
}
# Mostly well-formed bodies with a few fields drawn from the hostile sets: a value only reaches the
# engine when everything else in the request is valid.
VALID = {
    "max_tokens": st.integers(1, 24), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400), "min_p": st.floats(0, 1), "seed": st.integers(-(2**80), 2**80),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3), "repetition_context_size": st.integers(1, 10**6),
}
FIELD = st.sampled_from(sorted(SHARED)).flatmap(
    lambda name: st.tuples(st.just(name), st.one_of(VALID[name], VALID[name], SHARED[name])
                           if name in VALID else SHARED[name]))


def body(base, extra_fields):
    """A well-formed base with up to five fields set from FIELD (plus per-endpoint extras)."""
    fields = st.lists(st.one_of(FIELD, FIELD, extra_fields), max_size=5).map(dict)
    return st.tuples(base, fields).map(lambda bf: {"model": MODEL_ID, "max_tokens": 8, **bf[0], **bf[1]})


CHAT = body(
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=4)
                           | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}),
                                      min_size=1, max_size=2)}),
    st.tuples(st.sampled_from(["max_completion_tokens", "chat_template_kwargs", "messages", "logprobs", "top_logprobs",
                               "tools", "tool_choice", "response_format", "parallel_tool_calls"]),
              INTS | JUNK | st.booleans() | st.dictionaries(TEXT, ANY, max_size=3) | st.lists(MESSAGE, max_size=3)
              | st.sampled_from([{"type": "json_object"}, {"type": "text"}, "auto", "none", "required"])),
)
COMPLETION = body(
    st.fixed_dictionaries({"prompt": TEXT | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)}),
    st.tuples(st.sampled_from(["prompt", "logprobs"]),
              TEXT | INTS | st.lists(INTS, max_size=6) | st.lists(TEXT, max_size=2) | JUNK),
)
PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]) | JUNK,
                              "text": TEXT | JUNK})
ITEM = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference"])
     | JUNK},
    optional={"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]) | JUNK,
              "content": TEXT | st.lists(PART, max_size=3) | JUNK, "call_id": TEXT | JUNK, "name": TEXT | JUNK,
              "arguments": TEXT | st.just('{"a": 1}') | JUNK, "output": TEXT | JUNK,
              "summary": st.lists(st.fixed_dictionaries({"type": st.just("summary_text"), "text": TEXT}),
                                  max_size=2) | JUNK},
)
FUNCTION = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | JUNK, "name": TEXT | JUNK},
                                 optional={"parameters": st.just({"type": "object"}) | JUNK, "strict": ANY})
# Codex's tools: namespaces of function tools (MCP servers'), and hosted tools beside them.
NAMESPACE = st.fixed_dictionaries({"type": st.just("namespace"), "name": TEXT | JUNK},
                                  optional={"description": TEXT | JUNK, "tools": st.lists(FUNCTION, max_size=2) | JUNK})
HOSTED = st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "code_interpreter",
                                                         "computer_use_preview", "custom"])},
                               optional={"name": TEXT, "unknown_field": ANY})
# /v1/responses: its own field names (max_output_tokens, input, text.format, reasoning.effort) over a
# mostly well-formed base, as for chat.
RESPONSE_FIELDS = {
    "max_output_tokens": INTS | JUNK, "temperature": FLOATS | JUNK, "top_p": FLOATS | JUNK,
    "stream": st.booleans() | JUNK, "draft": st.booleans() | JUNK, "copies": COPIES, "instructions": TEXT | JUNK, "store": ANY, "metadata": ANY, "user": ANY,
    "input": TEXT | st.lists(ITEM, max_size=4) | JUNK,
    "tools": st.lists(FUNCTION | NAMESPACE | HOSTED, max_size=3) | JUNK,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"},
                                    {"type": "function", "name": "f", "namespace": "ns"},
                                    {"type": "web_search"}, {"type": "custom", "name": "f"}]) | JUNK,
    "client_metadata": ANY, "prompt_cache_key": ANY, "conversation": ANY,
    "parallel_tool_calls": ANY, "previous_response_id": TEXT | JUNK, "include": ANY, "unknown_field": ANY,
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
                             {"format": {"type": "json_schema"}}, {"verbosity": "low"}]) | JUNK,
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "minimal", "low", "x"])
                                                     | JUNK, "summary": TEXT | JUNK}) | JUNK,
}
RESPONSES = st.tuples(
    st.fixed_dictionaries({"model": st.just(MODEL_ID), "max_output_tokens": st.integers(1, 24),
                           "input": TEXT | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}),
                                                    min_size=1, max_size=2),
                           "reasoning": st.just({"effort": "none"})}),
    st.lists(st.sampled_from(sorted(RESPONSE_FIELDS)).flatmap(
        lambda name: st.tuples(st.just(name), RESPONSE_FIELDS[name])), max_size=4).map(dict),
).map(lambda bf: {**bf[0], **bf[1]})
STATUSES = {}  # (decode concurrency, drafting in batches) -> the statuses its fuzzed requests got
# One examples budget across the three routes.
REQUEST = (st.tuples(st.just("/v1/chat/completions"), CHAT) | st.tuples(st.just("/v1/completions"), COMPLETION)
           | st.tuples(st.just("/v1/responses"), RESPONSES))


@pytest.fixture(scope="module", params=[(1, False), (3, False), (3, True)],
                ids=["serial", "batched", "batched-drafting"])
def server(request, tiny_dir):
    folder = tiny_dir("tied-gqa2", max_position_embeddings=CONTEXT)
    concurrency, drafting = request.param
    with running_server(folder, SpecConfig("auto", 3), decode_concurrency=concurrency,
                        drafting_batch=drafting) as running:
        yield running
    # The strategies stay useful: after a full run, many requests were valid enough to reach the engine.
    got = STATUSES.get(request.param, [])
    assert len(got) < EXAMPLES or got.count(200) >= EXAMPLES // 3, got


@pytest.fixture(scope="module")
def expected(server):
    lm = server.served.lm
    return detokenize(lm, plain_greedy(lm, lm.tokenizer.encode(CHECK_PROMPT), 10))


# Headers a web page or a confused client sends: a foreign Host (DNS rebinding), a body type a page
# can send without a CORS preflight, none; and the ones that must pass.
HEADERS = st.fixed_dictionaries({}, optional={
    "host": st.sampled_from(["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost",
                             "api.localhost:1", "[::1]:9", "", "127.0.0.1:1"]),
    "content-type": st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                     "application/json; charset=utf-8", "APPLICATION/JSON", "application/jsonx",
                                     ""]),
})
FOREIGN = ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "")


def expected_refusal(headers) -> int:
    """The status the headers alone earn (0: none)."""
    if headers.get("host") in FOREIGN:
        return 403
    kind = headers.get("content-type", "application/json").split(";")[0].lower()
    return 0 if kind == "application/json" else 415


def send(url: str, path: str, body, headers=None) -> tuple:
    """(status, parsed body or SSE events) of one raw request; JSON with NaN/Infinity as Python writes it."""
    raw = json.dumps(body).encode()
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + path, content=raw,
                           headers={"content-type": "application/json", **(headers or {})}) as r:
            text = r.read().decode()
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                return r.status_code, [line[6:] for line in text.split("\n") if line.startswith("data: ")]
            return r.status_code, json.loads(text)


def well_formed(url: str) -> str:
    status, body = send(url, "/v1/completions", {"model": MODEL_ID, "prompt": CHECK_PROMPT, "max_tokens": 10,
                                                 "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(request=REQUEST, headers=st.one_of(st.just({}), st.just({}), HEADERS))
# Values that once broke the engine or the server (seed past MLX's range, top_k past the vocabulary,
# a non-ASCII digit as a logit_bias key, a client's own chat template).
@example(request=("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 1, "seed": 2**64}), headers={})
@example(request=("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                          "temperature": 1, "top_k": 10**9}), headers={})
@example(request=("/v1/completions", {"prompt": "x", "max_tokens": 4, "logit_bias": {"²": 1}}), headers={})
@example(request=("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                          "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}), headers={})
def test_no_request_gets_a_5xx_or_hurts_another(server, expected, request, headers):
    path, body = request
    with ThreadPoolExecutor(2) as pool:
        fuzzed = pool.submit(send, server.url, path, body, headers)
        check = pool.submit(well_formed, server.url)
        status, reply = fuzzed.result(timeout=120)
        assert check.result(timeout=120) == expected
    assert status < 500, (status, reply)
    if expected_refusal(headers):
        assert status == expected_refusal(headers), (headers, status, reply)
    worker = server.served.worker
    STATUSES.setdefault((worker.concurrency, worker.concurrency > 1 and worker.drafting), []).append(status)
    if status != 200:
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert "\n" not in error["message"]
    elif path == "/v1/responses" and isinstance(reply, list):  # its semantic events, the last the Response
        kinds = [json.loads(event)["type"] for event in reply]
        assert kinds[-1] in ("response.completed", "response.incomplete") and "error" not in kinds, kinds
    elif path == "/v1/responses":
        assert reply["status"] in ("completed", "incomplete") and reply["object"] == "response"
    elif isinstance(reply, list):  # a stream: it ends properly, and no error was sent in it
        assert reply[-1] == "[DONE]"
        assert not any('"error"' in event for event in reply[:-1]), reply
    else:
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.get("/health").status_code == 200

