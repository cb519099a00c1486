"""What a chat request's tools need below the APIs: whether the model can take them, the tools as
the chat template shows them, the grammar the answer follows, and the stream that parses its calls.

Thinking under a constraint: when the prompt leaves a reasoning block open (a Qwen template with
thinking on writes `<think>\\n`), the grammar lets the model think first (free text up to
`</think>`), then holds the answer to the tool call or the format. Turning thinking off instead
would answer a different prompt than the one the client asked for, and Qwen3.5-family models
call tools better after thinking; a client that wants no thinking says so (chat_template_kwargs
{"enable_thinking": false}, Anthropic's thinking disabled), as without a constraint.
"""

from typing import List, Optional, Tuple

from speculative.constraints import Constraint, ToolCalls, ToolSchema, combine, constraint_for
from speculative.errors import DynoError
from speculative.loader import LoadedModel

from .parsers import ToolCallStream, tool_call_format
from .request import ChatRequest, Tool
from .textstream import initial_channel

NO_PARAMETERS = {"type": "object", "properties": {}}  # the arguments of a tool given without a schema


def check_tools(lm: LoadedModel, request: ChatRequest) -> None:
    """DynoError unless a tool choice that requires a call has tools to call, and the model's template
    takes tools (when the answer may call one)."""
    if request.tool_choice.forced and not request.tools:
        raise DynoError("invalid tool_choice: it requires a tool call but no tools were given")
    if request.calls_allowed and tool_call_format(lm.tokenizer) is None:
        raise DynoError("invalid tools: this model's chat template has no tool calls")


def template_tool(tool: Tool) -> dict:
    """A tool as chat templates take it (Hugging Face's function form; absent fields left out)."""
    function = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = dict(tool.parameters)
    return {"type": "function", "function": function}


def template_tools(request: ChatRequest) -> Optional[List[dict]]:
    """The tools the template shows; None when the answer may not call one (tool choice none:
    the model is not told about them)."""
    return [template_tool(t) for t in request.tools] if request.calls_allowed else None


def callable_tools(request: ChatRequest) -> Tuple[ToolSchema, ...]:
    """The tools a call may name: the one a named choice names, else every tool offered."""
    choice = request.tool_choice
    tools = [t for t in request.tools if choice.mode != "named" or t.name == choice.name]
    if not tools:
        raise DynoError(f"invalid tool_choice: no tool named {choice.name!r} in tools")
    return tuple(ToolSchema(t.name, NO_PARAMETERS if t.parameters is None else t.parameters) for t in tools)


def answer_constraint(lm: LoadedModel, prompt: List[int], request: ChatRequest,
                      response: Optional[Constraint] = None) -> Optional[Constraint]:
    """The grammar the answer follows, or None: the forced call of tool choice required or named;
    else the response format (`response`, compiled), or either a call or that format when tools may
    be called; else, for strict tools, text or calls that follow their schemas. After the reasoning
    the prompt opened, if any (see the module docstring)."""
    allowed = request.calls_allowed
    forced = allowed and request.tool_choice.forced
    tools = callable_tools(request) if forced else None  # a named tool that is not offered: the error
    # A forced call or a format already holds the arguments.
    strict = allowed and response is None and any(t.strict for t in request.tools)
    answers = []
    if forced or strict or (allowed and response is not None):
        format = tool_call_format(lm.tokenizer)
        if format is None or format.form is None:
            name = "none" if format is None else format.name
            raise DynoError(f"invalid tool_choice: a tool call cannot be enforced in this model's tool-call "
                            f"format ({name}); use tool_choice auto, without response_format or strict tools")
        calls = ToolCalls(tools or callable_tools(request), format.form, request.parallel_tool_calls,
                          format.start + "\n", "\n" + format.end)
        answers.append(constraint_for(calls, lm))
    if response is not None and not forced:  # a forced call is the whole answer: no message to format
        answers.append(response)
    if not answers:
        return None
    thinking = initial_channel(lm.tokenizer, prompt) == "reasoning"
    return combine(answers, lm, lm.tokenizer.think_end if thinking else None, optional=strict and not forced)


def tool_call_stream(lm: LoadedModel, request: ChatRequest) -> Optional[ToolCallStream]:
    """The parser of the answer's tool calls; None when it may not call one."""
    tools = template_tools(request)
    if tools is None:
        return None
    return ToolCallStream.for_tokenizer(lm.tokenizer, tools, request.parallel_tool_calls)
