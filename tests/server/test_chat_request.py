"""Both APIs hand the runtime one ChatRequest: equivalent OpenAI and Anthropic requests make the same
request, the same prompt and the same grammar. And what each API's own fields mean (response_format,
tool_choice) is translated at the API, not in the engine."""

import dataclasses

import pytest

from dyno_ui.paths import BUNDLED_MODEL
from dyno_ui.runtime import chat
from dyno_ui.runtime.errors import ApiError
from dyno_ui.runtime.request import EFFORT_BUDGETS, ChatRequest, Tool, ToolChoice
from dyno_ui.runtime.served import ServedModel
from dyno_ui.runtime.tools import answer_constraint, callable_tools
from dyno_ui.server.anthropic import convert as anthropic_convert
from dyno_ui.server.anthropic import schema as anthropic_api
from dyno_ui.server.openai import convert as openai_convert
from dyno_ui.server.openai import schema as openai_api
from speculative.constraints import JsonSchema, constraint_for, tool_call_schema
from speculative.errors import DynoError
from speculative.loader import load_checkpoint
from speculative.thinking_budget import budget_for

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
SYSTEM, ASK = "You check the weather.", "Weather in Paris, then in Rome?"

OPENAI = {
    "model": "dyno-tiny", "max_tokens": 50, "temperature": 0, "stop": ["\n\n"],
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "add", "description": "Adds", "parameters": ADD}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": False,
}
ANTHROPIC = {
    "model": "dyno-tiny", "max_tokens": 50, "temperature": 0, "stop_sequences": ["\n\n"],
    "system": SYSTEM,
    "messages": [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"}]},
    ],
    "tools": [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
              {"name": "add", "description": "Adds", "input_schema": ADD}],
    "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
}


def from_openai(**changes) -> ChatRequest:
    return openai_convert.chat_request(openai_api.ChatCompletionRequest(**{**OPENAI, **changes}))


def from_anthropic(**changes) -> ChatRequest:
    return anthropic_convert.chat_request(anthropic_api.MessagesRequest(**{**ANTHROPIC, **changes}))


@pytest.fixture(scope="module")
def served():
    lm = load_checkpoint(BUNDLED_MODEL)
    return ServedModel("dyno-tiny", lm, worker=None, default_max_tokens=64, created=0)


def job(served, request):
    return chat.job_for(served, request, lambda item: None)[1]


def test_equivalent_requests_are_one_chat_request():
    # Adaptive thinking is the template's default, as an OpenAI request without chat_template_kwargs.
    openai, anthropic = from_openai(), from_anthropic(thinking={"type": "adaptive"})
    assert openai == anthropic
    assert from_anthropic().thinking is False  # no thinking field: disabled, as in Anthropic's API
    no_field = anthropic_api.MessagesRequest(**ANTHROPIC)
    assert anthropic_convert.chat_request(no_field, default_thinking=True) == anthropic  # --default-thinking
    assert openai.tool_choice == ToolChoice.named("get_weather") and not openai.parallel_tool_calls
    assert openai.messages[2].tool_calls[0].arguments == {"city": "Paris"}  # the JSON text, as an object


@pytest.mark.parametrize("openai, anthropic", [
    ({"chat_template_kwargs": {"enable_thinking": False}}, {}),  # a forced named call; no thinking field
    ({"chat_template_kwargs": {"enable_thinking": False}, "tool_choice": "required"},
     {"thinking": {"type": "disabled"}, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}),
    ({"tool_choice": "auto", "parallel_tool_calls": None,
      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     {"tool_choice": {"type": "auto"}, "output_config": {"format": {"type": "json_schema", "schema": PERSON}},
      "thinking": {"type": "adaptive"}}),
    ({"tool_choice": "none", "chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "low"},
     {"tool_choice": {"type": "none"}, "thinking": {"type": "enabled", "budget_tokens": 512}}),
], ids=["named", "required, no thinking", "auto with a format", "none, thinking"])
def test_both_apis_make_the_same_job(served, openai, anthropic):
    """The same prompt token ids, the same grammar and sampling, the same stops and tool-call parsing."""
    a, b = job(served, from_openai(**openai)), job(served, from_anthropic(**anthropic))
    assert a.prompt == b.prompt
    assert a.params == b.params and (a.params.constraint is not None) == ("none" not in str(openai))
    assert a.text.stops == b.text.stops == ["\n\n"]
    calls_a, calls_b = a.text.calls, b.text.calls
    assert (calls_a is None) == (calls_b is None)
    if calls_a is not None:
        assert (calls_a.tools, calls_a.parallel) == (calls_b.tools, calls_b.parallel)
    counted = anthropic_convert.count_tokens(served, anthropic_api.CountTokensRequest(
        **{k: v for k, v in {**ANTHROPIC, **anthropic}.items() if k not in ("max_tokens", "temperature",
                                                                            "stop_sequences")}))
    assert counted == len(b.prompt)


# ---- response_format (OpenAI): translated by the API, compiled by the engine ----

def compiled(response_format, lm):
    spec = openai_convert.format_spec(response_format)
    return None if spec is None else constraint_for(spec, lm)


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}, "invalid JSON schema: "),
    ({"type": "xml"}, "invalid response_format: type must be text, json_object or json_schema, got 'xml'"),
    ({"type": "json_schema"}, "invalid response_format: json_schema must be an object with a schema"),
    ([1], "invalid response_format: must be an object"),
])
def test_invalid_response_format(served, response_format, message):
    with pytest.raises((DynoError, ApiError)) as e:
        compiled(response_format, served.lm)
    assert e.value.message.startswith(message) and "\n" not in e.value.message


def test_response_formats(served):
    bundled = served.lm
    assert compiled(None, bundled) is None
    assert compiled({"type": "text"}, bundled) is None
    assert compiled({"type": "json_object"}, bundled).kind == "json_object"
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert compiled(schema, bundled) == constraint_for(JsonSchema(PERSON), bundled)
    assert compiled({"type": "json_schema", "json_schema": {"name": "p"}}, bundled).kind == "json_object"


# ---- tool_choice: resolved once by the API; which tools a call may name, by the runtime ----

def test_tool_choice_picks_the_tools_a_call_may_name(served):
    openai_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                    {"type": "function", "function": {"name": "add", "parameters": ADD}}]
    named = {"type": "function", "function": {"name": "add"}}
    one = tool_call_schema(callable_tools(from_openai(tools=openai_tools, tool_choice=named)))
    assert one["properties"]["name"] == {"const": "add"}
    assert one["properties"]["arguments"] == ADD
    both = tool_call_schema(callable_tools(from_openai(tools=openai_tools, tool_choice="required")))
    assert [s["properties"]["name"]["const"] for s in both["anyOf"]] == ["get_weather", "add"]
    anthropic = from_anthropic(tools=[{"name": "add", "input_schema": ADD}],
                               tool_choice={"type": "tool", "name": "add"})
    assert tool_call_schema(callable_tools(anthropic)) == one
    with pytest.raises(DynoError, match="no tool named 'mul' in tools"):
        callable_tools(from_openai(tool_choice={"type": "function", "function": {"name": "mul"}}))
    prompt = chat.prompt_for(served, from_openai(tool_choice="auto")).tokens
    for choice in ("auto", "none"):  # nothing to hold the answer to
        assert answer_constraint(served.lm, prompt, from_openai(tool_choice=choice)) is None
    # A tool given without parameters takes an object with any properties.
    assert callable_tools(ChatRequest((), tools=(Tool("f"),), tool_choice=ToolChoice("required")))[0].parameters == {
        "type": "object", "properties": {}}


# ---- the thinking budget: each API's field, else the server's --reasoning-budget ----

@pytest.mark.parametrize("effort", list(EFFORT_BUDGETS))
def test_reasoning_effort_is_a_thinking_budget(effort):
    assert from_openai(reasoning_effort=effort).thinking_budget == EFFORT_BUDGETS[effort]
    assert from_openai().thinking_budget is None


def test_anthropic_budget_tokens_is_the_thinking_budget():
    assert from_anthropic(thinking={"type": "enabled", "budget_tokens": 96}).thinking_budget == 96
    assert from_anthropic(thinking={"type": "disabled", "budget_tokens": 96}).thinking_budget is None
    assert from_anthropic(thinking={"type": "enabled"}).thinking_budget is None


def test_a_request_without_a_budget_gets_the_servers(served):
    request = from_openai(chat_template_kwargs={"enable_thinking": True}, tool_choice="none")
    assert job(served, request).params.thinking_budget is None  # no --reasoning-budget: unlimited
    tokens = job(served, request).prompt
    with_default = dataclasses.replace(served, reasoning_budget=40)
    budget = job(with_default, request).params.thinking_budget
    assert budget == budget_for(served.lm, 40, tokens) and budget.open and budget.budget == 40
    assert job(with_default, from_openai(chat_template_kwargs={"enable_thinking": True}, tool_choice="none",
                                         reasoning_effort="minimal")).params.thinking_budget.budget == 0
