"""The thinking budget through a real server and the official clients: Anthropic's
`thinking.budget_tokens`, OpenAI's `reasoning_effort` and the server's `--reasoning-budget` close the
think block with Qwen's phrase at the same token as plain decoding under that budget, with drafting
on (serial and batched) as with it off; and a forced tool call after budgeted thinking is a call."""

import json

import pytest

from dyno_ui.options import ServeOptions
from dyno_ui.paths import BUNDLED_MODEL
from helpers.serving import MODEL_ID, detokenize, running_server, split_think
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token
from speculative.thinking_budget import CLOSING_PHRASE, budget_for

pytestmark = pytest.mark.e2e

DEFAULT = 64  # the servers' --reasoning-budget
OPTIONS = ServeOptions(reasoning_budget=DEFAULT)
ASK = [{"role": "user", "content": "def f(x):"}]  # dyno-tiny thinks past 120 tokens after this, unbudgeted
GREEDY = {"temperature": 0}
SERVERS = {"drafting": dict(spec=SpecConfig("mtp", 3)), "plain": dict(spec=SpecConfig("off")),
           "batched": dict(spec=SpecConfig("mtp", 3), decode_concurrency=2, drafting_batch=True)}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request):
    with running_server(BUNDLED_MODEL, options=OPTIONS, **SERVERS[request.param]) as running:
        yield running


_references = {}


def reference(lm, budget, max_tokens):
    """(content, reasoning) of plain greedy decoding under `budget` (None: none) after the thinking prompt
    (each server loads the same checkpoint: computed once)."""
    if (budget, max_tokens) not in _references:
        _references[budget, max_tokens] = _reference(lm, budget, max_tokens)
    return _references[budget, max_tokens]


def _reference(lm, budget, max_tokens):
    prompt = list(lm.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True,
                                                   enable_thinking=True))
    spec = None if budget is None else budget_for(lm, budget, prompt)
    params = SamplingParams(max_tokens=max_tokens, thinking_budget=spec)
    tokens = [e.id for e in generate(lm, prompt, params, SpecConfig("off")) if isinstance(e, Token)]
    if spec is not None:  # the budget ran out inside the block: the phrase closes it
        assert tokens[budget : budget + len(spec.phrase)] == list(spec.phrase)
    return split_think(detokenize(lm, tokens), thinking=True)


def openai_answer(server, max_tokens, **kw):
    out = server.client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=max_tokens,
                                                extra_body=GREEDY, **kw)
    message = out.choices[0].message
    return message.content, message.reasoning_content


def anthropic_answer(server, max_tokens, budget_tokens):
    out = server.anthropic().messages.create(model=MODEL_ID, max_tokens=max_tokens, messages=ASK, extra_body=GREEDY,
                                             thinking={"type": "enabled", "budget_tokens": budget_tokens})
    blocks = {b.type: b for b in out.content}
    return blocks["text"].text if "text" in blocks else "", blocks["thinking"].thinking


def closed(reasoning: str) -> bool:
    return reasoning.strip().endswith(CLOSING_PHRASE.split("</think>")[0].strip())


@pytest.mark.parametrize("budget_tokens", [8])
def test_anthropic_budget_tokens(server, budget_tokens):
    content, reasoning = reference(server.served.lm, budget_tokens, 100)
    got = anthropic_answer(server, 100, budget_tokens)
    assert got[1].strip() == reasoning.strip() and closed(got[1])
    assert got[0].strip() == content.strip() != ""


@pytest.mark.parametrize("effort, budget", [("minimal", 0), (None, DEFAULT)])
def test_openai_reasoning_effort_else_the_server_budget(server, effort, budget):
    """minimal is a budget of 0; no effort the server's (so is high's, which has no budget of its own)."""
    content, reasoning = reference(server.served.lm, budget, 120)
    kw = {} if effort is None else {"reasoning_effort": effort}
    got_content, got_reasoning = openai_answer(server, 120, **kw)
    assert got_reasoning.strip() == reasoning.strip() and closed(got_reasoning)
    assert (got_content or "").strip() == content.strip() != ""


def test_a_budget_the_answer_does_not_reach_changes_nothing(server):
    """low is 512 tokens: past max_tokens, the answer is the unbudgeted one."""
    content, reasoning = reference(server.served.lm, None, 40)
    got_content, got_reasoning = openai_answer(server, 40, reasoning_effort="low")
    assert got_reasoning == reasoning and not closed(got_reasoning) and not got_content


def test_forced_tool_call_after_budgeted_thinking(server):
    """Named tool_choice (one call) with thinking on and a 64-token budget at max_tokens 200: the think
    block is closed by the phrase, then the grammar holds the answer to the call, which completes.
    (Unbudgeted, dyno-tiny thinks through all 200 tokens and never calls.)"""
    out = server.client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Add 2 and 3."}], max_tokens=200, extra_body=GREEDY,
        tools=[{"type": "function", "function": {"name": "add", "parameters": ADD}}],
        tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False)
    assert closed(out.choices[0].message.reasoning_content)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    message = server.anthropic().messages.create(
        model=MODEL_ID, max_tokens=200, messages=[{"role": "user", "content": "Add 2 and 3."}], extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": DEFAULT},
        tools=[{"name": "add", "input_schema": ADD}], tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use", message
    assert closed(message.content[0].thinking)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["add"] and set(uses[0].input) == {"a", "b"}
