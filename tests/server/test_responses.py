"""/v1/responses (OpenAI's Responses API) through the official openai client over a real socket, with
drafting on: text, reasoning, tool calls and JSON answers equal mlx-lm's plain greedy decoding of the
same templated prompt (under the same grammar), streamed or not; bad requests are one-line 400s."""

import json

import jsonschema
import openai
import pytest

from dyno_ui.paths import BUNDLED_MODEL
from helpers.reference import plain_constrained as plain, plain_greedy, template_tokens as template
from helpers.serving import MODEL_ID, detokenize, drafted, running_server, split_think
from speculative.config import SpecConfig
from speculative.constraints import JsonSchema, ToolCalls, ToolSchema, constraint_for

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
ANSWER = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
NO_THINKING = {"effort": "none"}
SYSTEM = "You write Python."
ASK = [{"role": "user", "content": "A stack, please."}]


@pytest.fixture(scope="module")
def server():
    with running_server(BUNDLED_MODEL, SpecConfig("mtp", 3)) as running:
        yield running






def events(server, **kw):
    """A streamed request's events, checked for what every stream holds: consecutive sequence
    numbers, the lifecycle events first and last, each item added before its deltas and done."""
    got = list(server.client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in got] == list(range(len(got)))
    assert [e.type for e in got[:2]] == ["response.created", "response.in_progress"]
    assert got[-1].type in ("response.completed", "response.incomplete")
    added = [e.output_index for e in got if e.type == "response.output_item.added"]
    done = [e.output_index for e in got if e.type == "response.output_item.done"]
    assert added == done == list(range(len(got[-1].response.output)))
    assert {e.response.id for e in got if hasattr(e, "response")} == {got[0].response.id}
    return got


def deltas(got, kind):
    return "".join(e.delta for e in got if e.type == kind)




def test_text_equals_plain_decoding_streamed_or_not(server):
    lm = server.served.lm
    before = server.stats()
    kw = dict(model=MODEL_ID, instructions=SYSTEM, input=ASK, max_output_tokens=24, temperature=0,
              reasoning=NO_THINKING)
    whole = server.client.responses.create(**kw)
    prompt = template(lm, [{"role": "system", "content": SYSTEM}] + ASK)
    reference = plain_greedy(lm, prompt, 24)
    assert whole.output_text == detokenize(lm, reference) and len(reference) == 24  # cut by max_output_tokens
    (message,) = whole.output
    assert (message.type, message.role, message.status, message.content[0].annotations) == (
        "message", "assistant", "incomplete", [])
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL_ID
    assert (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens) == (
        len(prompt), 24, len(prompt) + 24)
    assert whole.usage.output_tokens_details.reasoning_tokens == 0 and whole.instructions == SYSTEM

    got = events(server, **kw)
    assert deltas(got, "response.output_text.delta") == whole.output_text
    assert [e.type for e in got if "delta" not in e.type] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    final = got[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 24
    assert got[-4].text == whole.output_text and got[-2].item.status == "incomplete"
    assert drafted(server, before) > 0
    # Both count as requests, as chat completions do.
    assert server.stats()["requests"]["total"] - before["requests"]["total"] == 2


def test_reasoning_comes_as_a_reasoning_item(server):
    """Thinking on (the template's default): the model is still thinking when max_output_tokens cuts it."""
    lm = server.served.lm
    kw = dict(model=MODEL_ID, input="def f", max_output_tokens=20, temperature=0)
    whole = server.client.responses.create(**kw)
    reference = plain_greedy(lm, template(lm, [{"role": "user", "content": "def f"}], thinking=True), 20)
    content, reasoning = split_think(detokenize(lm, reference), thinking=True)
    (item,) = whole.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", reasoning)] and not content
    assert item.status == "incomplete" and whole.output_text == ""
    assert whole.usage.output_tokens_details.reasoning_tokens == 20
    got = events(server, **kw)
    assert deltas(got, "response.reasoning_text.delta") == reasoning
    assert [e.text for e in got if e.type == "response.reasoning_text.done"] == [reasoning]
    assert got[-1].response.output[0].content[0].text == reasoning


def test_tool_loop_with_a_forced_call_equals_plain_decoding(server):
    """function_call, then its function_call_output, then the answer: each turn as plain decoding gives it."""
    lm = server.served.lm
    client, before = server.client, server.stats()
    kw = dict(model=MODEL_ID, input=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
              max_output_tokens=200, temperature=0, reasoning=NO_THINKING)
    first = client.responses.create(**kw)
    (call,) = first.output
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    reference = plain(lm, template(lm, ask, chat_tools),
                      constraint_for(ToolCalls((ToolSchema("get_weather", WEATHER["parameters"]),), "json", False), lm),
                      200)
    written = detokenize(lm, reference)
    body = json.loads(written[written.index("{"):written.rindex("}") + 1])
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == body["arguments"] and call.call_id.startswith("call_")
    assert first.status == "completed" and first.usage.output_tokens == len(reference) - 1  # not the EOS
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    got = events(server, **kw)
    assert deltas(got, "response.function_call_arguments.delta") == call.arguments
    (done,) = [e for e in got if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and got[-1].type == "response.completed"

    # The call replayed as the client's SDK sends it back, with its result.
    history = kw["input"] + [call.model_dump(exclude_none=True),
                             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    second = client.responses.create(**{**kw, "input": history, "tool_choice": "none", "max_output_tokens": 12})
    replayed = ask + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": json.loads(call.arguments)}}]},
                      {"role": "tool", "content": "18 C, sunny"}]
    prompt = template(lm, replayed)  # tool choice none: the template is not shown the tools
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in lm.tokenizer.decode(prompt)
    assert second.usage.input_tokens == len(prompt)
    assert second.output_text == detokenize(lm, plain_greedy(lm, prompt, 12))
    assert drafted(server, before) > 0


def test_json_schema_format_streamed_or_not(server):
    lm = server.served.lm
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    kw = dict(model=MODEL_ID, input="Give JSON.", max_output_tokens=80, temperature=0, reasoning=NO_THINKING,
              text={"format": fmt})
    whole = server.client.responses.create(**kw)
    reference = plain(lm, template(lm, [{"role": "user", "content": "Give JSON."}]),
                      constraint_for(JsonSchema(ANSWER), lm), 80)
    assert whole.output_text == detokenize(lm, reference) and whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), ANSWER)
    assert whole.text.format.type == "json_schema" and whole.text.format.name == "answer"
    with server.client.responses.stream(**kw) as stream:  # the SDK's own accumulation
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text
    obj = server.client.responses.create(model=MODEL_ID, input="Give JSON.", max_output_tokens=60, temperature=0,
                                         reasoning=NO_THINKING, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_a_call_cut_by_max_output_tokens_is_no_call(server):
    tool = {**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    kw = dict(model=MODEL_ID, input="Weather?", tools=[tool], tool_choice="required", temperature=0,
              reasoning=NO_THINKING)
    # Cut before the call's name, or inside its arguments: no call (calls go out whole), an empty
    # incomplete message, and none of the call's markup as text.
    for limit in (8, 24):
        cut = server.client.responses.create(max_output_tokens=limit, **kw)
        assert [o.type for o in cut.output] == ["message"] and cut.output_text == ""
        assert cut.status == "incomplete" and cut.output[0].status == "incomplete"
    got = events(server, max_output_tokens=24, **kw)
    assert got[-2].item.status == "incomplete" and got[-1].type == "response.incomplete"
    assert not [e for e in got if e.type.startswith("response.function_call_arguments")]
    assert all("<tool_call>" not in getattr(e, "delta", "") for e in got)


def test_the_next_turn_reports_the_reused_prefix(server):
    lm = server.served.lm
    kw = dict(model=MODEL_ID, instructions=SYSTEM, max_output_tokens=9, temperature=0, reasoning=NO_THINKING)
    first = server.client.responses.create(input=ASK, **kw)
    turn2 = ASK + [o.model_dump(exclude_none=True) for o in first.output] + [{"role": "user", "content": "A queue."}]
    second = server.client.responses.create(input=turn2, **kw)
    system = [{"role": "system", "content": SYSTEM}]
    prompt1 = template(lm, system + ASK)
    prompt2 = template(lm, system + ASK + [{"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": "A queue."}])
    assert prompt2[:len(prompt1) + 9] == prompt1 + plain_greedy(lm, prompt1, 9)  # the answer re-tokenizes to itself
    # The first turn's last token was pending (never fed), so one less than prompt + answer is reused.
    assert second.usage.input_tokens_details.cached_tokens == len(prompt1) + 9 - 1
    assert second.usage.input_tokens == len(prompt2)
    assert second.output_text == detokenize(lm, plain_greedy(lm, prompt2, 9))


def test_store_metadata_and_user_are_accepted_and_nothing_is_kept(server):
    out = server.client.responses.create(model=MODEL_ID, input="x", max_output_tokens=2, store=True,
                                         metadata={"k": "v"}, user="u", reasoning=NO_THINKING)
    assert (out.store, out.metadata, out.user, out.previous_response_id) == (False, {"k": "v"}, "u", None)
    with pytest.raises(openai.BadRequestError) as e:
        server.client.responses.create(model=MODEL_ID, input="x", previous_response_id=out.id)
    assert e.value.status_code == 400 and e.value.body["message"] == (
        "previous_response_id: this server keeps no responses; send the whole conversation as input")


BAD = [
    ({}, "input: Field required", "input"),
    ({"input": 5}, "input: must be a string or a non-empty list of items", "input"),
    ({"input": []}, "input: must be a string or a non-empty list of items", "input"),
    ({"input": "x", "temperature": "hot"}, "temperature: Input should be a valid number, unable to parse string "
                                          "as a number", "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens: Input should be greater than or equal to 1",
     "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]},
     "input.0.type: items of type 'item_reference' are not supported (only message, function_call, "
     "function_call_output, reasoning)", "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input.0.content.0.image_url: must be a data: URL (file_id images are not supported)",
     "input.0.content.0.image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input.0.content.0.type: only text and image content is supported, got 'input_file'", "input.0.content.0.type"),
    ({"input": [{"role": "robot", "content": "x"}]},
     "input.0.role: Input should be 'user', 'system', 'developer' or 'assistant'", "input.0.role"),
    ({"input": "x", "tools": [WEATHER, {"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice: the hosted tool 'web_search' runs on OpenAI's side; this server cannot run it (offer a "
     "function tool instead)", "tool_choice"),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"},
     "tool_choice: \"required\" forces a call, and the only tools are hosted ones (web_search), which run on "
     "OpenAI's side: this server cannot run them", "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}},
     "tool_choice.type: must be \"function\" (a named function tool), got 'allowed_tools'", "tool_choice.type"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
     "tools.0.tools.0.type: a namespace may hold only function tools here", "tools.0.tools.0.type"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "invalid tool_choice: no tool named 'nope' in tools", "tool_choice"),
    ({"input": "x", "reasoning": {"effort": "ultra"}},
     "reasoning.effort: Input should be 'none', 'minimal', 'low', 'medium' or 'high'", "reasoning.effort"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema: a json_schema format needs a schema", "text.format.schema"),
    ({"input": "x", "background": True}, "background: background responses are not supported", "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]},
     "include: only reasoning.encrypted_content may be included (reasoning comes as plain text)", "include"),
    ({"input": "x", "model": "other"}, None, "model"),
]


@pytest.mark.parametrize("body, message, param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_requests_are_one_line_400s(server, body, message, param):
    r = server.post("/v1/responses", json={"model": MODEL_ID, **body} if "model" not in body else body)
    error = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert error["param"] == param and error["type"] in ("invalid_request_error", "not_found_error")
    if message is not None:
        assert error["message"] == message
    assert "\n" not in error["message"]


def test_every_event_validates_as_the_sdks_types_and_a_failure_ends_the_stream(server):
    """Each event the Reply makes, a failure mid-stream included, validated strictly by the openai
    package's own stream-event union (its client only constructs them)."""
    from typing import get_args

    from openai.types.responses import ResponseStreamEvent

    from dyno_ui.runtime.outputs import Failed, Finished, TextDelta, ToolCallDelta
    from dyno_ui.server.openai import responses_convert, responses_schema

    req = responses_schema.ResponsesRequest.model_validate({"model": MODEL_ID, "input": "x", "tools": [WEATHER]})
    members = get_args(get_args(ResponseStreamEvent)[0])
    kinds = {get_args(m.model_fields["type"].annotation)[0]: m for m in members}

    def run(outputs):
        _, job = responses_convert.responses_job(server.served, req, lambda item: None)  # made, never submitted
        reply = responses_convert.Reply(req, MODEL_ID, job)
        got = reply.start() + [e for item in outputs for e in reply.on(item)]
        for event in got:
            kinds[event.type].model_validate(event.model_dump(mode="json"))
        return got

    done = run([TextDelta("reasoning", "hm"), TextDelta("content", "Hi"), ToolCallDelta(0, "{", id="call_1", name="f"),
                ToolCallDelta(0, "}"), Finished("stop", 5, 4, 0)])
    assert [e.type for e in done][-6:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [o.type for o in done[-1].response.output] == ["reasoning", "message", "function_call"]
    failed = run([TextDelta("content", "Hi"), Failed("generation failed: boom")])
    assert [e.type for e in failed[-2:]] == ["error", "response.failed"]
    assert failed[-2].message == "generation failed: boom" and failed[-1].response.status == "failed"
    assert failed[-1].response.error.message == "generation failed: boom"
