"""The Anthropic Messages API through the official `anthropic` client over a real socket: exact text
with drafting on, the stream's event sequence, tool use and tool results, count_tokens, errors.

The bundled dyno-tiny is the model: its chat template is Qwen's, with tools and tool calls.
"""

import json
import logging

import anthropic
import httpx
import jsonschema
import pytest

from dyno_ui.paths import BUNDLED_MODEL
from helpers.reference import plain_greedy
from helpers.serving import MODEL_ID, detokenize, running_server, split_think
from speculative.config import SamplingParams, SpecConfig
from speculative.constraints import JsonSchema, ToolCalls, ToolSchema, constraint_for
from speculative.engine import generate
from speculative.events import Token

pytestmark = pytest.mark.e2e

SYSTEM = "You write Python."
ASK = [{"role": "user", "content": "Show me a Python class named `Stack`."}]
GREEDY = {"temperature": 0}  # the SDK no longer has a temperature argument; the API still takes it
NO_THINKING = {"type": "disabled"}  # dyno-tiny answers in code only with its think block closed
JSON_TYPE = {"content-type": "application/json"}  # a body sent without it is a 415
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
TEMPLATE_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                    "parameters": WEATHER}}]
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}  # any tool, one call: the tiny model must call


@pytest.fixture(scope="module")
def server():
    with running_server(BUNDLED_MODEL, SpecConfig("mtp", 3)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.anthropic()


def template(lm, messages, **kw):
    """Token ids of the conversation through the model's own chat template, thinking closed unless said."""
    kw.setdefault("enable_thinking", False)
    return list(lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw))


def default_template(lm, messages):
    """Token ids of the conversation through the chat template with its own default (no enable_thinking)."""
    return list(lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def expected_stop(lm, tokens):
    return "end_turn" if tokens[-1] in lm.eos_token_ids else "max_tokens"


def test_text_equals_plain_decoding_with_drafting_on(server, client):
    lm = server.served.lm
    prompt = template(lm, [{"role": "system", "content": SYSTEM}] + ASK)
    reference = plain_greedy(lm, prompt, 48)
    content, reasoning = split_think(detokenize(lm, reference))
    assert content and not reasoning
    before = server.stats()
    out = client.messages.create(model=MODEL_ID, max_tokens=48, system=SYSTEM, messages=ASK, thinking=NO_THINKING,
                                 extra_body=GREEDY)
    assert [(b.type, b.text) for b in out.content] == [("text", content)]
    assert (out.role, out.model, out.stop_reason, out.stop_sequence) == ("assistant", MODEL_ID,
                                                                         expected_stop(lm, reference), None)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(prompt)
    assert out.usage.output_tokens == len(reference)
    after = server.stats()  # the same engine and counters as the OpenAI routes, drafting on
    assert after["requests"]["total"] - before["requests"]["total"] == 1
    assert after["tokens"]["generated"] - before["tokens"]["generated"] == len(reference)
    assert after["speculative"]["rounds"] > before["speculative"]["rounds"]
    assert after["speculative"]["accepted_tokens"] > before["speculative"]["accepted_tokens"]


def test_prefill_is_continued_exactly_with_drafting_on(server, client):
    """A final assistant message is the answer's start: the reply is plain greedy decoding of the
    template's prompt with that text written after it, and holds only what follows."""
    lm = server.served.lm
    prefill = "class Stack:\n    def"
    text = lm.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    prompt = list(lm.tokenizer.encode(text + prefill, add_special_tokens=False))
    assert prompt[: len(template(lm, ASK))] == template(lm, ASK)  # the template's tokens, then the prefill's
    reference = plain_greedy(lm, prompt, 40)
    messages = ASK + [{"role": "assistant", "content": [{"type": "text", "text": "class Stack:\n"},
                                                        {"type": "text", "text": "    def"}]}]
    message = client.messages.create(model=MODEL_ID, max_tokens=40, messages=messages, thinking=NO_THINKING,
                                     extra_body=GREEDY)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == detokenize(lm, reference)
    assert message.usage.input_tokens == len(prompt)
    with client.messages.stream(model=MODEL_ID, max_tokens=40, messages=messages, thinking=NO_THINKING,
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == detokenize(lm, reference)
    counted = client.messages.count_tokens(model=MODEL_ID, messages=messages, thinking=NO_THINKING)
    assert counted.input_tokens == len(prompt)
    # Adaptive (the template's default) dyno-tiny's template opens a think block; a prefill closes it first.
    default = client.messages.create(model=MODEL_ID, max_tokens=40, messages=messages, thinking={"type": "adaptive"},
                                     extra_body=GREEDY)
    assert [(b.type, b.text) for b in default.content] == [("text", detokenize(lm, reference))]


def test_an_empty_final_assistant_message_starts_the_answer_afresh(server, client):
    lm = server.served.lm
    reference = plain_greedy(lm, template(lm, ASK), 24)
    message = client.messages.create(model=MODEL_ID, max_tokens=24, thinking=NO_THINKING, extra_body=GREEDY,
                                     messages=ASK + [{"role": "assistant", "content": ""}])
    assert message.content[0].text == detokenize(lm, reference)


def test_stream_sends_the_documented_event_sequence(server, client):
    kw = dict(model=MODEL_ID, max_tokens=30, system=SYSTEM, messages=ASK, thinking=NO_THINKING, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = len(kinds) - 5
    assert deltas >= 2
    assert kinds == (["message_start", "content_block_start"] + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])
    start, block = events[0], events[1]
    assert start.message.content == [] and start.message.role == "assistant" and start.message.model == MODEL_ID
    assert start.message.usage.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert (block.index, block.content_block.type, block.content_block.text) == (0, "text", "")
    assert all(e.index == 0 and e.delta.type == "text_delta" for e in events[2:2 + deltas])
    assert "".join(e.delta.text for e in events[2:2 + deltas]) == whole.content[0].text
    final = events[-2]
    assert (final.delta.stop_reason, final.delta.stop_sequence) == (whole.stop_reason, None)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == start.message.usage.input_tokens
    with client.messages.stream(**kw) as stream:  # the SDK's own accumulator agrees
        assert [(b.type, b.text) for b in stream.get_final_message().content] == [("text", whole.content[0].text)]


def test_next_turn_reads_the_cached_prefix(server, client):
    """cache_read_input_tokens: the prompt tokens reused from the previous turn; input_tokens the rest."""
    lm = server.served.lm
    first = client.messages.create(model=MODEL_ID, max_tokens=9, messages=ASK, thinking=NO_THINKING, extra_body=GREEDY)
    turn2 = ASK + [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "A queue."}]
    prompt1, prompt2 = template(lm, ASK), template(lm, turn2)
    assert prompt2[: len(prompt1) + 9] == prompt1 + plain_greedy(lm, prompt1, 9)  # the answer re-tokenizes to itself
    second = client.messages.create(model=MODEL_ID, max_tokens=5, messages=turn2, thinking=NO_THINKING,
                                    extra_body=GREEDY)
    # The first turn's last token was pending (never fed), so one less than prompt + answer is reused.
    assert second.usage.cache_read_input_tokens == len(prompt1) + 9 - 1
    assert second.usage.input_tokens == len(prompt2) - second.usage.cache_read_input_tokens


def test_reasoning_comes_back_as_a_thinking_block(server, client):
    lm = server.served.lm
    prompt = template(lm, ASK, enable_thinking=True)  # the template opens <think>
    reference = plain_greedy(lm, prompt, 20)
    content, reasoning = split_think(detokenize(lm, reference), thinking=True)
    assert reasoning and not content
    kw = dict(model=MODEL_ID, max_tokens=20, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024},
              extra_body=GREEDY)
    out = client.messages.create(**kw)
    assert [(b.type, b.thinking) for b in out.content] == [("thinking", reasoning)]
    events = list(client.messages.create(stream=True, **kw))
    assert events[1].content_block.type == "thinking"
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta") == reasoning


def test_no_thinking_field_means_thinking_disabled(server, client):
    """As in Anthropic's API: a request without `thinking` is answered as one with thinking disabled,
    although dyno-tiny's template opens a think block by default."""
    lm = server.served.lm
    assert default_template(lm, ASK) != template(lm, ASK)  # the template's default thinks
    reference = plain_greedy(lm, template(lm, ASK), 24)
    kw = dict(model=MODEL_ID, max_tokens=24, messages=ASK, extra_body=GREEDY)
    absent, disabled = client.messages.create(**kw), client.messages.create(thinking=NO_THINKING, **kw)
    assert [(b.type, b.text) for b in absent.content] == [("text", detokenize(lm, reference))]
    assert absent.content == disabled.content and absent.usage == disabled.usage
    events = list(client.messages.create(stream=True, **kw))
    assert {e.content_block.type for e in events if e.type == "content_block_start"} == {"text"}
    counted = client.messages.count_tokens(model=MODEL_ID, messages=ASK)
    assert counted.input_tokens == len(template(lm, ASK))


def test_default_thinking_keeps_the_templates_default():
    """--default-thinking: no `thinking` field is the template's default (dyno-tiny's thinks), as
    `adaptive` is (tests/test_docs.py checks that `python app.py` takes the flag too)."""
    from dyno_ui import cli
    from dyno_ui.cli.serve import options_from
    from dyno_ui.options import ServeOptions

    assert options_from(cli.build_parser().parse_args(["serve", "--default-thinking"])).default_thinking
    assert not options_from(cli.build_parser().parse_args(["serve"])).default_thinking
    with running_server(BUNDLED_MODEL, SpecConfig("mtp", 3), options=ServeOptions(default_thinking=True)) as server:
        lm, client = server.served.lm, server.anthropic()
        prompt = default_template(lm, ASK)
        reasoning = split_think(detokenize(lm, plain_greedy(lm, prompt, 20)), thinking=True)[1]
        assert reasoning
        kw = dict(model=MODEL_ID, max_tokens=20, messages=ASK, extra_body=GREEDY)
        absent = client.messages.create(**kw)
        assert [(b.type, b.thinking) for b in absent.content] == [("thinking", reasoning)]
        assert absent.content == client.messages.create(thinking={"type": "adaptive"}, **kw).content
        assert client.messages.count_tokens(model=MODEL_ID, messages=ASK).input_tokens == len(prompt)
        disabled = client.messages.create(thinking=NO_THINKING, **kw)  # a request's own field still rules
        assert [b.type for b in disabled.content] == ["text"]


def test_stop_sequence_ends_the_answer(server, client):
    lm = server.served.lm
    full = split_think(detokenize(lm, plain_greedy(lm, template(lm, ASK), 30)))[0]
    stop = full[10:13]
    out = client.messages.create(model=MODEL_ID, max_tokens=30, messages=ASK, thinking=NO_THINKING,
                                 stop_sequences=["never there", stop], extra_body=GREEDY)
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    assert out.content[0].text == full[: full.index(stop)]


def test_forced_tool_use_then_tool_result(server, client):
    """tool_choice any: a valid call, exactly plain decoding's under the same grammar; then the result."""
    lm = server.served.lm
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = template(lm, ask, tools=TEMPLATE_TOOLS)
    assert client.messages.count_tokens(model=MODEL_ID, messages=ask, tools=TOOLS, tool_choice=ONE_CALL,
                                        thinking=NO_THINKING).input_tokens == len(prompt)
    constraint = constraint_for(ToolCalls((ToolSchema("get_weather", WEATHER),), parallel=False), lm)
    plain = [e.id for e in generate(lm, prompt, SamplingParams(max_tokens=120, constraint=constraint),
                                    SpecConfig("off")) if isinstance(e, Token)]
    text = detokenize(lm, plain)
    call = json.loads(text[len("<tool_call>\n"): -len("\n</tool_call>")])
    before = server.stats()
    out = client.messages.create(model=MODEL_ID, max_tokens=120, messages=ask, tools=TOOLS, tool_choice=ONE_CALL,
                                 thinking=NO_THINKING, extra_body=GREEDY)
    # The answer ends with its one call (disable_parallel_tool_use): the EOS the grammar allows next is not drawn.
    assert plain[-1] in lm.eos_token_ids and out.usage.output_tokens == len(plain) - 1
    assert out.stop_reason == "tool_use" and out.stop_sequence is None
    assert server.stats()["speculative"]["accepted_tokens"] > before["speculative"]["accepted_tokens"]
    (use,) = out.content
    assert (use.type, use.name, use.input) == ("tool_use", call["name"], call["arguments"])
    assert use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    # Streamed: one tool_use block, its name first, then its whole input as JSON text (sent once complete).
    events = list(client.messages.create(stream=True, model=MODEL_ID, max_tokens=120, messages=ask, tools=TOOLS,
                                         tool_choice=ONE_CALL, thinking=NO_THINKING, extra_body=GREEDY))
    kinds = [e.type for e in events]
    pieces = 1
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    assert (events[1].content_block.type, events[1].content_block.name) == ("tool_use", use.name)
    assert events[1].content_block.input == {}
    assert all(e.delta.type == "input_json_delta" and e.index == 0 for e in events[2:2 + pieces])
    assert json.loads("".join(e.delta.partial_json for e in events[2:2 + pieces])) == use.input
    assert events[-2].delta.stop_reason == "tool_use"

    # The next turn replays the call and its result through the template as tool_calls and a tool message.
    turn2 = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                      "input": use.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "18 C, sunny"}]}]
    prompt2 = template(lm, ask + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C, sunny"}], tools=TEMPLATE_TOOLS)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in lm.tokenizer.decode(prompt2)
    assert client.messages.count_tokens(model=MODEL_ID, messages=turn2, tools=TOOLS,
                                        thinking=NO_THINKING).input_tokens == len(prompt2)
    reference = plain_greedy(lm, prompt2, 30)
    content = split_think(detokenize(lm, reference))[0]
    assert "<tool_call>" not in content  # this answer is text: what tool_choice auto must pass through as text
    out2 = client.messages.create(model=MODEL_ID, max_tokens=30, messages=turn2, tools=TOOLS, thinking=NO_THINKING,
                                  extra_body=GREEDY)
    assert [(b.type, b.text) for b in out2.content] == [("text", content)]
    assert out2.stop_reason == expected_stop(lm, reference)
    assert out2.usage.input_tokens + out2.usage.cache_read_input_tokens == len(prompt2)


def test_output_config_format_is_a_grammar_with_drafting_on(server, client):
    """output_config.format: JSON valid against the schema, exactly plain decoding's under the same grammar."""
    lm = server.served.lm
    ask = [{"role": "user", "content": "Which city is the capital of France?"}]
    prompt = template(lm, ask)
    constraint = constraint_for(JsonSchema(WEATHER), lm)
    plain = [e.id for e in generate(lm, prompt, SamplingParams(max_tokens=80, constraint=constraint),
                                    SpecConfig("off")) if isinstance(e, Token)]
    out = client.messages.create(model=MODEL_ID, max_tokens=80, messages=ask, thinking=NO_THINKING, extra_body=GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    assert [(b.type, b.text) for b in out.content] == [("text", detokenize(lm, plain))]
    assert out.usage.output_tokens == len(plain) and out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), WEATHER)


def test_count_tokens_is_the_templated_prompt(server, client):
    lm = server.served.lm
    system = [{"type": "text", "text": "You write "}, {"type": "text", "text": "Python."}]
    counted = client.messages.count_tokens(model=MODEL_ID, system=system, messages=ASK, thinking=NO_THINKING)
    assert counted.input_tokens == len(template(lm, [{"role": "system", "content": SYSTEM}] + ASK))
    thinking = client.messages.count_tokens(model=MODEL_ID, messages=ASK, thinking={"type": "enabled",
                                                                                    "budget_tokens": 1024})
    assert thinking.input_tokens == len(template(lm, ASK, enable_thinking=True))


SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}


def test_a_server_tool_is_left_out_and_the_answer_is_as_without(server, client, caplog):
    ask = dict(model=MODEL_ID, max_tokens=8, messages=ASK, thinking=NO_THINKING, extra_body={"temperature": 0})
    plain = client.messages.create(**ask, tools=TOOLS)
    with caplog.at_level(logging.INFO, logger="dyno.serve"):
        offered = client.messages.create(**ask, tools=TOOLS + [SEARCH])
    prompt = [u.input_tokens + u.cache_read_input_tokens for u in (plain.usage, offered.usage)]
    assert offered.content == plain.content and prompt[0] == prompt[1]
    assert "dyno: /v1/messages: left out server tools this server cannot run: web_search" in caplog.messages


def error_of(response: httpx.Response) -> tuple:
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    return response.status_code, body["error"]["type"], body["error"]["message"]


@pytest.mark.parametrize("body, status, kind, says", [
    ({"model": MODEL_ID, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "use a vision-language conversion"),  # dyno-tiny's tower is a placeholder
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK, "tools": TOOLS + [SEARCH],
      "tool_choice": {"type": "tool", "name": "web_search"}},
     400, "invalid_request_error", "tool_choice: 'web_search' forces a call of a server tool (web_search), which "
                                   "runs on Anthropic's side: this server cannot run it (offer a custom tool instead)"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK, "tools": [SEARCH], "tool_choice": {"type": "any"}},
     400, "invalid_request_error", "tool_choice: 'any' forces a call of a server tool (web_search)"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK, "tools": [{"type": "bash_20250124", "name": "bash"}]},
     400, "invalid_request_error", "tool type 'bash_20250124' is not supported"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "no tools"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool",
                                                                                          "name": "nope"}},
     400, "invalid_request_error", "'nope'"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK + [{"role": "assistant", "content": "class "}]},
     400, "invalid_request_error", "trailing whitespace"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]}],
      "tools": TOOLS}, 400, "invalid_request_error", "text blocks only"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK + [{"role": "assistant", "content": "class"}],
      "tools": TOOLS, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "forced tool_choice"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK + [{"role": "assistant", "content": "{"}],
      "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}}, 400, "invalid_request_error",
     "output_config.format"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": ASK + [{"role": "assistant", "content": "class"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking enabled"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": [{"role": "assistant", "content": "class"}]}, 400,
     "invalid_request_error", "needs a user message"),
    ({"model": MODEL_ID, "max_tokens": 5, "messages": [{"role": "user", "content": "y" * 5000}]}, 400,
     "invalid_request_error", "maximum context length"),
    ({"model": "claude-opus-4", "max_tokens": 5, "messages": ASK}, 404, "not_found_error", "claude-opus-4"),
], ids=["no max_tokens", "temperature", "image block", "forced server tool", "any with only a server tool",
        "a tool only Claude knows", "any without tools", "unknown tool",
        "prefill with trailing space", "prefill with a tool call", "prefill with a forced call",
        "prefill with a format", "prefill with thinking", "prefill alone", "too long", "unknown model"])
def test_errors_are_anthropic_shaped(server, body, status, kind, says):
    got = error_of(server.post("/v1/messages", json=body))
    assert got[:2] == (status, kind) and says in got[2]


def test_every_error_on_these_routes_is_anthropic_shaped_and_openai_keeps_its_own(server, client):
    bad_json = server.post("/v1/messages", content=b'{"model":', headers=JSON_TYPE)
    assert error_of(bad_json)[:2] == (400, "invalid_request_error")
    assert error_of(server.post("/v1/messages/count_tokens", json={"model": MODEL_ID}))[:2] == (
        400, "invalid_request_error")
    assert error_of(server.post("/v1/messages/batches", json={}))[:2] == (404, "not_found_error")
    assert error_of(server.get("/v1/messages"))[:2] == (405, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL_ID, max_tokens=0, messages=ASK)
    openai_error = server.post("/v1/chat/completions", content=b'{"model":', headers=JSON_TYPE).json()
    assert set(openai_error) == {"error"} and openai_error["error"]["type"] == "invalid_request_error"
    assert server.post("/v1/nothing", json={}).json()["error"]["type"] == "not_found_error"


def test_a_job_the_engine_fails_is_an_error_response_or_an_error_event(tiny_dir):
    """After message_start a failure can only be an `error` event; before it, an error response."""
    with running_server(tiny_dir(), SpecConfig("auto", 2)) as server:
        server.served.worker.close(15)  # a stopped engine answers every job with a 503
        body = {"model": MODEL_ID, "max_tokens": 5, "messages": ASK}
        assert error_of(server.post("/v1/messages", json=body)) == (503, "overloaded_error",
                                                                    "the server is shutting down")
        r = server.post("/v1/messages", json=dict(body, stream=True))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [(e.split("\n")[0], json.loads(e.split("\n")[1][len("data: "):]))
                  for e in r.text.strip().split("\n\n")]
        assert [name for name, _ in events] == ["event: message_start", "event: error"]
        assert events[1][1] == {"type": "error", "error": {"type": "overloaded_error",
                                                           "message": "the server is shutting down"}}
        with pytest.raises(anthropic.APIStatusError, match="overloaded_error"):
            list(server.anthropic().messages.create(stream=True, **body))


def test_models_list_and_retrieve_in_anthropics_shape(server, client):
    """Both SDKs ask GET /v1/models; Anthropic's (it sends anthropic-version) gets its own shape."""
    page = client.models.list()
    assert [(m.type, m.id, m.display_name) for m in page.data] == [("model", MODEL_ID, MODEL_ID)]
    assert (page.has_more, page.first_id, page.last_id) == (False, MODEL_ID, MODEL_ID)
    assert page.data[0].created_at.timestamp() == server.served.created
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(anthropic.NotFoundError) as e:
        client.models.retrieve("claude-opus-4")
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message":
                            f"The model 'claude-opus-4' does not exist; this server serves '{MODEL_ID}'"}}
    headers = {"anthropic-version": "2023-06-01"}
    for query in ("after_id=nope", "limit=0", "limit=abc", f"after_id={MODEL_ID}&before_id={MODEL_ID}"):
        assert error_of(server.get(f"/v1/models?{query}", headers=headers))[:2] == (400, "invalid_request_error")
    for cursor in ("after_id", "before_id"):  # past either end: an empty last page
        empty = server.get(f"/v1/models?{cursor}={MODEL_ID}", headers=headers).json()
        assert empty == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    # OpenAI's list takes no query, and the header chooses the envelope on the shared path only.
    assert server.get("/v1/models?limit=abc").json()["object"] == "list"
    openai_error = server.post("/v1/chat/completions", content=b'{"model":', headers={**headers, **JSON_TYPE}).json()
    assert set(openai_error) == {"error"}


# ---- what agent clients send (Claude Code's request shape) ------------------------------------

REMINDER = "Available sub-agents: general-purpose."
BETAS = {"anthropic-version": "2023-06-01", "x-app": "cli",
         "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"}


def agent_body(messages, **kw):
    """A /v1/messages body as Claude Code shapes it: system blocks and text blocks with cache_control,
    a mid-conversation system message, adaptive thinking, context_management, output_config, metadata."""
    return {"model": MODEL_ID, "max_tokens": 24, "messages": messages, "temperature": 0,
            "system": [{"type": "text", "text": "You write ", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Python."}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "user_1_account_2_session_3"}, **kw}


def agent_turn(text=ASK[0]["content"]):
    return [{"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": [{"type": "text", "text": REMINDER, "cache_control": {"type": "ephemeral"}}]}]


def test_a_system_message_inside_messages_is_a_system_turn_with_drafting_on(server, client):
    """dyno-tiny's template renders a system turn after a user turn: the reply is plain decoding of
    that prompt (adaptive: the template's default, which thinks); a reply that ends inside its think
    block with no text is counted in /stats."""
    lm = server.served.lm
    assert "<|im_start|>system\n" + REMINDER in lm.tokenizer.apply_chat_template(
        ASK + [{"role": "system", "content": REMINDER}, ASK[0]], tokenize=False)  # the template's own turn
    prompt = default_template(lm, [{"role": "system", "content": SYSTEM}] + ASK + [{"role": "system",
                                                                                    "content": REMINDER}])
    reference = plain_greedy(lm, prompt, 24)
    content, reasoning = split_think(detokenize(lm, reference), thinking=True)
    assert reasoning and not content
    before = server.stats()
    r = server.post("/v1/messages?beta=true", json=agent_body(agent_turn()), headers=BETAS)
    assert r.status_code == 200, r.text
    assert [(b["type"], b["thinking"]) for b in r.json()["content"]] == [("thinking", reasoning)]
    assert r.json()["stop_reason"] == expected_stop(lm, reference)
    streamed = server.post("/v1/messages?beta=true", json=agent_body(agent_turn(), stream=True), headers=BETAS)
    assert streamed.status_code == 200 and "event: message_stop" in streamed.text
    after = server.stats()
    assert after["requests"]["ended_in_thinking"] - before["requests"]["ended_in_thinking"] == 2
    assert after["speculative"]["accepted_tokens"] > before["speculative"]["accepted_tokens"]
    assert server.metrics()["mlx:requests_ended_in_thinking_total"] >= 2
    counted = server.post("/v1/messages/count_tokens?beta=true", headers=BETAS,
                          json={k: v for k, v in agent_body(agent_turn()).items() if k != "max_tokens"})
    assert counted.json() == {"input_tokens": len(prompt)}
    # The official client sends the same (system messages are in its MessageParam).
    out = client.messages.create(model=MODEL_ID, max_tokens=24, system=SYSTEM, messages=agent_turn(),
                                 thinking={"type": "adaptive"}, output_config={"effort": "medium"},
                                 metadata={"user_id": "u"}, extra_headers={"anthropic-beta": BETAS["anthropic-beta"]},
                                 extra_body={"context_management": {"edits": []}, **GREEDY})
    assert [(b.type, b.thinking) for b in out.content] == [("thinking", reasoning)]


def first_turn(client, lm, turn, prompt) -> str:
    """`turn` through the Anthropic client, 9 greedy tokens: plain greedy decoding of `prompt`; returns the text."""
    out = client.messages.create(model=MODEL_ID, max_tokens=9, messages=turn, thinking=NO_THINKING, extra_body=GREEDY)
    assert out.content[0].text == detokenize(lm, plain_greedy(lm, prompt, 9))
    return out.content[0].text


def next_turn_reuses(client, lm, turn, prompt1, prompt2) -> None:
    """The turn after `first_turn`: `prompt2` extends turn 1's prompt and answer, its text is plain greedy
    decoding of `prompt2`, and the prompt cache gives back all of turn 1 but its last token."""
    assert prompt2[: len(prompt1) + 9] == prompt1 + plain_greedy(lm, prompt1, 9)
    second = client.messages.create(model=MODEL_ID, max_tokens=5, messages=turn, thinking=NO_THINKING,
                                    extra_body=GREEDY)
    assert second.content[0].text == split_think(detokenize(lm, plain_greedy(lm, prompt2, 5)))[0]
    assert second.usage.cache_read_input_tokens == len(prompt1) + 9 - 1


def test_the_next_turn_after_a_system_message_reads_the_cached_prefix(server, client):
    lm = server.served.lm
    turn1 = ASK + [{"role": "system", "content": REMINDER}]
    prompt1 = template(lm, turn1)
    answer = first_turn(client, lm, turn1, prompt1)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "A queue."}]
    next_turn_reuses(client, lm, turn2, prompt1, template(lm, turn2))


def test_effort_and_adaptive_thinking_set_the_thinking_budget(server):
    """output_config.effort low is a 512-token budget, medium 2048, high and above the server's;
    budget_tokens wins over it; disabled thinking has none (convert.chat_request's mapping)."""
    from dyno_ui.server.anthropic import convert
    from dyno_ui.server.anthropic.schema import MessagesRequest

    def budget(**kw):
        req = MessagesRequest.model_validate({"model": MODEL_ID, "max_tokens": 5, "messages": ASK, **kw})
        got = convert.chat_request(req)
        return got.thinking, got.thinking_budget

    adaptive = {"type": "adaptive"}
    assert budget(thinking=adaptive, output_config={"effort": "low"}) == (None, 512)
    assert budget(thinking=adaptive, output_config={"effort": "medium"}) == (None, 2048)
    assert budget(thinking=adaptive, output_config={"effort": "max"}) == (None, None)
    assert budget(thinking={"type": "enabled", "budget_tokens": 64}, output_config={"effort": "low"}) == (True, 64)
    assert budget(thinking={"type": "enabled"}, output_config={"effort": "low"}) == (True, 512)
    assert budget(thinking=NO_THINKING, output_config={"effort": "low"}) == (False, None)
    assert budget(output_config={"effort": "low"}) == (False, None)  # no thinking field: none
    turn = ASK + [{"role": "system", "content": "Be quick.", "output_config": {"effort": "low"}}]
    assert budget(thinking=adaptive, messages=turn, output_config={"effort": "high"}) == (None, 512)
    cleared = [ASK[0], {"role": "system", "content": REMINDER, "clear_at": "next_user_message"}, ASK[0]]
    assert [m.role for m in convert.chat_request(MessagesRequest.model_validate(
        {"model": MODEL_ID, "max_tokens": 5, "messages": cleared})).messages] == ["user", "user"]
    assert error_of(server.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 5, "messages": ASK,
                                                       "output_config": {"effort": "huge"}}))[:2] == (
        400, "invalid_request_error")


@pytest.mark.parametrize("message, says", [
    ({"role": "tool", "content": "x"}, 'messages.1: Unexpected role "tool". Allowed roles are "user", "assistant" '
                                       'or "system"'),
    ({"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}]},
     "messages.1: role 'system' is not supported on this model with content blocks of type 'tool_addition' "
     "(this server takes text blocks there)"),
], ids=["unknown role", "system block"])
def test_role_refusals_are_worded_as_anthropics(server, message, says):
    r = server.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 5, "messages": ASK + [message]})
    assert (r.status_code, r.headers["x-should-retry"]) == (400, "false")
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": says}}


def test_errors_say_whether_to_retry_and_the_root_answers(server):
    as_json = {"content-type": "application/json"}
    for r in (server.post("/v1/messages", content=b'{"model":', headers=as_json), server.get("/v1/messages"),
              server.post("/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": ASK}),
              server.post("/v1/messages/batches", json={}),
              server.post("/v1/chat/completions", content=b"{", headers=as_json),
              server.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"}),
              server.post("/v1/messages", json={}, headers={"host": "rebound.example"})):
        assert r.status_code in (400, 403, 404, 405, 415) and r.headers["x-should-retry"] == "false"
        assert "retry-after" not in r.headers
    head, get = httpx.head(server.url + "/", timeout=30), server.get("/")
    assert (head.status_code, head.content) == (200, b"")
    assert get.status_code == 200 and get.json() == {"name": "Dyno", "model": MODEL_ID, "api": "/v1"}


@pytest.fixture(scope="module")
def folding_server(tmp_path_factory):
    """dyno-tiny with its template changed to refuse a system message after the first, as Qwen3.5's
    own templates do ("System message must be at the beginning.")."""
    from transformers import AutoTokenizer

    from helpers.tiny_models import with_chat_template

    own = AutoTokenizer.from_pretrained(BUNDLED_MODEL).chat_template
    clause = '{%- if message.role == "user" or (message.role == "system" and not loop.first) %}'
    assert clause in own
    refusing = own.replace(clause, '{%- if message.role == "system" and not loop.first %}'
                                   "{{- raise_exception('System message must be at the beginning.') }}"
                                   '{%- elif message.role == "user" %}')
    folder = with_chat_template(BUNDLED_MODEL, tmp_path_factory.mktemp("refusing") / "dyno-tiny", refusing)
    with running_server(folder, SpecConfig("mtp", 3)) as running:
        yield running


def test_a_template_without_system_turns_gets_them_folded_into_user_turns(folding_server):
    """Folded as text where the prompt stays a prefix of the next turn's: after a user turn, into it;
    after an assistant turn, into the next user turn, or a user turn of its own. Exact, and the next
    turn reuses the cached prefix; the OpenAI chat API folds the same way."""
    server, lm = folding_server, folding_server.served.lm
    client = server.anthropic()
    with pytest.raises(Exception, match="must be at the beginning"):
        template(lm, ASK + [{"role": "system", "content": REMINDER}])
    turn1 = ASK + [{"role": "system", "content": REMINDER}]
    folded1 = [{"role": "user", "content": ASK[0]["content"] + "\n\n" + REMINDER}]
    prompt1 = template(lm, folded1)
    answer = first_turn(client, lm, turn1, prompt1)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "A queue."}]
    folded2 = folded1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Be brief.\n\nA queue."}]
    prompt2 = template(lm, folded2)
    next_turn_reuses(client, lm, turn2, prompt1, prompt2)
    ending = turn2[:4]  # a system message after the assistant's, nothing after it: a user turn of its own
    assert client.messages.count_tokens(model=MODEL_ID, messages=ending, thinking=NO_THINKING).input_tokens == len(
        template(lm, folded1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Be brief."}]))
    chat = server.client.chat.completions.create(
        model=MODEL_ID, max_tokens=5, temperature=0, messages=[{"role": "system", "content": SYSTEM}] + turn2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    reference = template(lm, [{"role": "system", "content": SYSTEM}] + folded2)
    assert chat.choices[0].message.content == split_think(detokenize(lm, plain_greedy(lm, reference, 5)))[0]
    assert chat.usage.prompt_tokens == len(reference)
