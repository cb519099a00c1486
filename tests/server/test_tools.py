"""Tool calls and structured output through the official openai client over a real socket, with drafting
on: every constrained answer equals mlx-lm's plain greedy decoding under the same grammar, token
for token, and parses and validates against its schema."""

import json

import jsonschema
import openai
import pytest
from mlx_lm.tool_parsers import qwen3_coder as mlx_qwen3_coder

from dyno_ui.paths import BUNDLED_MODEL
from helpers.reference import plain_constrained as plain, template_tokens as template
from helpers.serving import MODEL_ID, detokenize, drafted, running_server
from helpers.tool_models import XML_TEMPLATE, XML_TOOLS, with_template
from speculative.config import SpecConfig
from speculative.constraints import JsonSchema, ToolCalls, ToolSchema, combine, constraint_for


pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ANSWER = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


@pytest.fixture(scope="module")
def server():
    with running_server(BUNDLED_MODEL, SpecConfig("mtp", 3)) as running:
        yield running






def tool_calls(tools, lm, parallel=True, form="json"):
    """The grammar of calls of `tools` (in OpenAI's function form), compiled as the server compiles it."""
    schemas = tuple(ToolSchema(t["function"]["name"], t["function"]["parameters"]) for t in tools)
    return constraint_for(ToolCalls(schemas, form, parallel), lm)


def written_call(text):
    """(name, arguments exactly as written) of the one JSON-form call `text` holds."""
    assert text.startswith(OPEN) and text.endswith(CLOSE), text
    body = text[len(OPEN):-len(CLOSE)].rstrip()
    inner = body[:-1].rstrip()  # without the call object's closing brace
    arguments = inner[inner.index('"arguments"') + len('"arguments"'):].lstrip()[1:].lstrip()
    return json.loads(body)["name"], arguments


def one_call(message):
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    return call.function.name, call.function.arguments


def valid(name, arguments):
    """The arguments parse and validate against the named tool's parameters."""
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[name]
    jsonschema.validate(json.loads(arguments), tool["parameters"])
    return True




def test_required_tool_call_equals_plain_decoding_streamed_or_not(server):
    lm = server.served.lm
    before = server.stats()
    kw = dict(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=320, temperature=0, extra_body=NO_THINKING)
    whole = server.client.chat.completions.create(**kw)
    reference = plain(lm, template(lm, ASK, TOOLS), tool_calls(TOOLS, lm, parallel=False), 320)
    message = whole.choices[0].message
    assert one_call(message) == written_call(detokenize(lm, reference))
    assert valid(*one_call(message)) and message.content is None
    # Not parallel: the answer ends with its one call, before the EOS the grammar would force next.
    assert reference[-1] in lm.eos_token_ids and whole.usage.completion_tokens == len(reference) - 1
    assert whole.choices[0].finish_reason == "tool_calls"
    assert drafted(server, before) > len(reference) // 3  # drafting stayed on under the grammar

    chunks = list(server.client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    (call,) = [d.tool_calls[0] for d in deltas if d.tool_calls]  # the call whole, once its block closed
    assert (call.index, call.type, call.function.name, call.function.arguments) == (0, "function", *one_call(message))
    assert call.id.startswith("call_")
    assert not any(d.content for d in deltas) and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_with_several_calls_in_one_turn(server):
    lm = server.served.lm
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = server.client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=named,
                                                max_tokens=220, temperature=0, extra_body=NO_THINKING)
    reference = plain(lm, template(lm, ASK, TOOLS), tool_calls([WEATHER], lm), 220)
    # The grammar lets the turn end after each call (EOS allowed), but this model calls again and again
    # (parallel calls are on): complete calls, then one cut by max_tokens.
    assert out.usage.completion_tokens == len(reference) == 220
    blocks = [b if b.startswith(OPEN) else "<tool_call>" + b for b in detokenize(lm, reference).split("\n<tool_call>")]
    complete, cut = blocks[:-1], blocks[-1]
    assert len(complete) >= 2 and all(b.endswith(CLOSE) for b in complete) and not cut.endswith(CLOSE)
    message = out.choices[0].message
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    # The cut call is not a call: only the complete ones, and none of its text as content.
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [written_call(b) for b in complete]
    assert all(valid(c.function.name, c.function.arguments) for c in message.tool_calls)
    assert message.content is None and out.choices[0].finish_reason == "length"


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# The same tools as Anthropic's API takes them (a missing description is "" there), and as its template shows them.
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
ANTHROPIC_TEMPLATE_TOOLS = [{"type": "function", "function": {
    "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}} for t in ANTHROPIC_TOOLS]
ONE_WEATHER_CALL = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def undrafted():
    with running_server(BUNDLED_MODEL, SpecConfig("off")) as running:
        yield running


def keys_once(arguments):
    """The arguments' object, asserting that no object in the raw string holds a key twice."""
    def pairs(items):
        keys = [k for k, _ in items]
        assert len(keys) == len(set(keys)), arguments
        return dict(items)

    return json.loads(arguments, object_pairs_hook=pairs)


def test_arguments_hold_declared_keys_only_and_a_forced_call_ends(server, undrafted):
    """get_weather's schema says nothing of additionalProperties: its arguments hold `city` alone (the
    grammar once let this model invent keys, repeated, until max_tokens). A named call with parallel
    calls off is one call that ends the answer; drafting on equals drafting off and plain decoding."""
    lm = server.served.lm
    kw = dict(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False,
              max_tokens=200, temperature=0, extra_body=NO_THINKING)
    before = server.stats()
    out, off = server.client.chat.completions.create(**kw), undrafted.client.chat.completions.create(**kw)
    name, arguments = one_call(out.choices[0].message)
    assert name == "get_weather" and set(keys_once(arguments)) == {"city"} and valid(name, arguments)
    assert out.choices[0].finish_reason == off.choices[0].finish_reason == "tool_calls"
    assert one_call(off.choices[0].message) == (name, arguments)
    reference = plain(lm, template(lm, ASK, TOOLS), tool_calls([WEATHER], lm, parallel=False), 200)
    assert (name, arguments) == written_call(detokenize(lm, reference))
    assert out.usage.completion_tokens == off.usage.completion_tokens == len(reference) - 1  # not the EOS
    assert drafted(server, before) > 0

    anthropic = dict(model=MODEL_ID, max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS,
                     tool_choice=ONE_WEATHER_CALL, thinking={"type": "disabled"}, extra_body=GREEDY)
    message = server.anthropic().messages.create(**anthropic)
    message_off = undrafted.anthropic().messages.create(**anthropic)
    reference = plain(lm, template(lm, ASK, ANTHROPIC_TEMPLATE_TOOLS), tool_calls([WEATHER], lm, parallel=False), 200)
    written = written_call(detokenize(lm, reference))
    assert message.stop_reason == message_off.stop_reason == "tool_use"
    (use,) = message.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", keys_once(written[1]))
    assert [(b.name, b.input) for b in message_off.content] == [(use.name, use.input)] and set(use.input) == {"city"}


@pytest.mark.parametrize("cut", [12, 24, 29])  # inside the name, inside the arguments, after their closing brace
def test_a_call_cut_by_max_tokens_is_no_call(server, cut):
    """max_tokens inside the call: finish_reason length / stop_reason max_tokens, no call, no markup."""
    lm = server.served.lm
    reference = plain(lm, template(lm, ASK, TOOLS), tool_calls([WEATHER], lm, parallel=False), cut)
    assert detokenize(lm, reference).startswith(OPEN) and CLOSE not in detokenize(lm, reference)
    kw = dict(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False,
              max_tokens=cut, temperature=0, extra_body=NO_THINKING)
    out = server.client.chat.completions.create(**kw)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == cut
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content == ""
    chunks = [c for c in server.client.chat.completions.create(stream=True, **kw) if c.choices]
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "length"

    anthropic = dict(model=MODEL_ID, max_tokens=cut, messages=ASK, tools=ANTHROPIC_TOOLS,
                     tool_choice=ONE_WEATHER_CALL, thinking={"type": "disabled"}, extra_body=GREEDY)
    reference = plain(lm, template(lm, ASK, ANTHROPIC_TEMPLATE_TOOLS), tool_calls([WEATHER], lm, parallel=False), cut)
    assert detokenize(lm, reference).startswith(OPEN) and CLOSE not in detokenize(lm, reference)
    message = server.anthropic().messages.create(**anthropic)
    assert (message.stop_reason, message.content, message.usage.output_tokens) == ("max_tokens", [], cut)
    events = list(server.anthropic().messages.create(stream=True, **anthropic))
    assert [e.type for e in events] == ["message_start", "message_delta", "message_stop"]
    assert events[1].delta.stop_reason == "max_tokens"


def test_agent_loop_with_tool_results_equals_plain_decoding(server):
    """Call a tool, get its result, answer in a schema: two turns through the drafting engine."""
    lm = server.served.lm
    client, before = server.client, server.stats()
    first = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0,
                                           extra_body=NO_THINKING)
    (call,) = first.choices[0].message.tool_calls
    reference = plain(lm, template(lm, ASK, [WEATHER]),
                      tool_calls([WEATHER], lm, parallel=False), 200)
    assert (call.function.name, call.function.arguments) == written_call(detokenize(lm, reference))
    assert first.usage.completion_tokens == len(reference) - 1  # all but the EOS after the one call

    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    second = client.chat.completions.create(model=MODEL_ID, messages=history, tools=[WEATHER],
                                            response_format=response_format, max_tokens=120, temperature=0,
                                            extra_body=NO_THINKING)
    # The history as the template writes it: the call's arguments as an object, the result as a tool response.
    replayed = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
                      {"role": "tool", "content": '{"temperature": 21}'}]
    prompt = template(lm, replayed, [WEATHER])
    assert second.usage.prompt_tokens == len(prompt)
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in lm.tokenizer.decode(prompt)
    either = combine([tool_calls([WEATHER], lm), constraint_for(JsonSchema(ANSWER), lm)], lm)
    reference = plain(lm, prompt, either, 120)
    message = second.choices[0].message
    assert message.content == detokenize(lm, reference) and second.usage.completion_tokens == len(reference)
    jsonschema.validate(json.loads(message.content), ANSWER)  # it answered (the grammar allowed a call too)
    assert second.choices[0].finish_reason == "stop" and message.tool_calls is None
    assert drafted(server, before) > 0


def test_response_format_json_schema_streamed_or_not(server):
    lm = server.served.lm
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    kw = dict(model=MODEL_ID, messages=ASK, response_format=response_format, max_tokens=100, temperature=0,
              extra_body=NO_THINKING)
    whole = server.client.chat.completions.create(**kw)
    reference = plain(lm, template(lm, ASK), constraint_for(JsonSchema(ANSWER), lm), 100)
    assert whole.choices[0].message.content == detokenize(lm, reference)
    jsonschema.validate(json.loads(whole.choices[0].message.content), ANSWER)
    streamed = list(server.client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    obj = server.client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=60, temperature=0,
                                                response_format={"type": "json_object"}, extra_body=NO_THINKING)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_thinking_comes_before_the_constrained_answer(server):
    """The template opens <think> (thinking on, the default): the model thinks freely, then answers in the schema."""
    lm = server.served.lm
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    prompt = template(lm, ASK, thinking=True)
    after_thinking = combine([constraint_for(JsonSchema(ANSWER), lm)], lm, "</think>")
    thinking = server.client.chat.completions.create(model=MODEL_ID, messages=ASK, response_format=response_format,
                                                     max_tokens=16, temperature=0)
    reference = plain(lm, prompt, after_thinking, 16)
    message = thinking.choices[0].message
    assert message.reasoning_content == detokenize(lm, reference) and message.content == ""
    assert thinking.choices[0].finish_reason == "length"  # still thinking: this model never stops on its own
    # A bias on </think> ends the thinking at once; the answer then follows the schema.
    end = lm.tokenizer.convert_tokens_to_ids("</think>")
    answered = server.client.chat.completions.create(model=MODEL_ID, messages=ASK, response_format=response_format,
                                                     max_tokens=60, temperature=0, logit_bias={str(end): 5})
    reference = plain(lm, prompt, after_thinking, 60, logit_bias={end: 5.0})
    assert answered.choices[0].message.content == detokenize(lm, reference).split("</think>")[1]
    jsonschema.validate(json.loads(answered.choices[0].message.content), ANSWER)


def test_strict_tools_with_auto_choice(server):
    """strict: the model may answer in text, and the call it makes fits the tool's schema."""
    lm = server.served.lm
    strict = [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]
    start = lm.tokenizer.convert_tokens_to_ids("<tool_call>")
    grammar = combine([tool_calls([WEATHER], lm, parallel=False)], lm, optional=True)
    prompt = template(lm, ASK, [WEATHER])  # `strict` is not rendered
    for bias, n in ((None, 30), ({start: 100.0}, 130)):  # the bias makes the model start a call at once
        out = server.client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=strict, parallel_tool_calls=False, max_tokens=n, temperature=0,
            extra_body=dict(NO_THINKING, logit_bias={str(k): v for k, v in (bias or {}).items()}))
        reference = plain(lm, prompt, grammar, n, logit_bias=bias)
        message = out.choices[0].message
        if bias is None:  # text, as the model writes it under the grammar
            assert message.tool_calls is None and message.content == detokenize(lm, reference) != ""
        else:
            assert one_call(message) == written_call(detokenize(lm, reference)) and valid(*one_call(message))
            assert out.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "invalid JSON schema: Invalid type: objekt"),
    ({"response_format": {"type": "xml"}}, "response_format",
     "invalid response_format: type must be text, json_object or json_schema, got 'xml'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tool_choice", "invalid tool schema: "),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice",
     "invalid tool_choice: no tool named 'mul' in tools"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type",
     "tools.0.type: Input should be 'function'"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort",
     "reasoning_effort: Input should be 'minimal', 'low', 'medium' or 'high'"),
    ({"tool_choice": "required"}, "tool_choice",
     "invalid tool_choice: it requires a tool call but no tools were given"),
])
def test_invalid_structure_is_a_400_naming_it(server, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=4, extra_body=body)
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == param and error["message"].startswith(message)


CHAT_REFUSED = [("n", 2), ("audio", {"voice": "alloy", "format": "wav"}),
                ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
                ("verbosity", "low"), ("web_search_options", {}),
                ("functions", [{"name": "f"}]), ("function_call", "auto"), ("store", True)]
COMPLETION_REFUSED = [("n", 2), ("echo", True), ("suffix", "x"), ("best_of", 2)]


@pytest.mark.parametrize("field, value", CHAT_REFUSED)
def test_unimplemented_chat_fields_are_refused_by_name(server, field, value):
    r = server.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    error = r.json()["error"]
    assert error["message"].startswith(f"{field}: ") and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("field, value", COMPLETION_REFUSED)
def test_unimplemented_completion_fields_are_refused_by_name(server, field, value):
    r = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_no_op_values_of_those_fields_are_served(server):
    noop = {"n": 1, "logprobs": False, "top_logprobs": 0, "modalities": ["text"], "store": False, "audio": None}
    assert server.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **noop}).status_code == 200
    noop = {"n": 1, "echo": False, "suffix": "", "best_of": 1, "logprobs": None}
    assert server.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **noop}).status_code == 200


def test_tool_choice_none_leaves_tools_out(server):
    lm = server.served.lm
    out = server.client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice="none",
                                                max_tokens=12, temperature=0, extra_body=NO_THINKING)
    assert out.usage.prompt_tokens == len(template(lm, ASK))  # rendered without the tools
    assert out.choices[0].message.tool_calls is None


@pytest.fixture(scope="module")
def xml_server(tiny_dir, tmp_path_factory):
    folder = with_template(tiny_dir(), XML_TEMPLATE, tmp_path_factory.mktemp("xml") / "tiny")
    with running_server(folder, SpecConfig("mtp", 3)) as running:
        yield running


def test_xml_form_required_call_and_replay(xml_server):
    """Qwen3.5's <function=...><parameter=...> form: forced in that form, parsed by mlx-lm's qwen3_coder."""
    lm = xml_server.served.lm
    kw = dict(model=MODEL_ID, messages=ASK, tools=XML_TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    whole = xml_server.client.chat.completions.create(**kw)
    name, arguments = one_call(whole.choices[0].message)
    assert name == "pick" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), XML_TOOLS[0]["function"]["parameters"])
    constraint = tool_calls(XML_TOOLS, lm, form="xml")
    reference = plain(lm, template(lm, ASK, XML_TOOLS), constraint, 200)
    assert whole.usage.completion_tokens == len(reference)
    text = detokenize(lm, reference)
    assert text.startswith("<tool_call>\n<function=pick>\n<parameter=kind>\n") and text.endswith("</tool_call>")
    expected = mlx_qwen3_coder.parse_tool_call(text[len("<tool_call>"):-len("</tool_call>")], XML_TOOLS)
    assert arguments == json.dumps(expected["arguments"])  # what mlx-lm's own parser reads from the same text
    chunks = xml_server.client.chat.completions.create(stream=True, **kw)
    (streamed,) = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert (streamed.function.name, streamed.function.arguments) == (name, arguments)
    # Replayed, the arguments string becomes the object the template iterates over.
    history = ASK + [whole.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": whole.choices[0].message.tool_calls[0].id, "content": "ok"}]
    again = xml_server.client.chat.completions.create(model=MODEL_ID, messages=history, tools=XML_TOOLS,
                                                      max_tokens=1, temperature=0)
    replayed = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": name, "arguments": json.loads(arguments)}}]}, {"role": "tool", "content": "ok"}]
    assert again.usage.prompt_tokens == len(template(lm, replayed, XML_TOOLS))


def test_tools_for_a_template_without_tools_are_refused(tiny_dir):
    with running_server(tiny_dir()) as server:
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS, max_tokens=2)
    assert e.value.body["message"] == "invalid tools: this model's chat template has no tool calls"
    assert e.value.body["param"] == "tools"
