"""What a chat request with tools or a response format needs below the APIs: whether the model can
take tools, the grammar its answer follows, and the stream that parses its tool calls.

Tools and tool_choice arrive in OpenAI's shape ({"type": "function", "function": {"name",
"parameters"}}; "auto", "none", "required", a named function); speculative.constraints also reads
Anthropic's tool_choice forms ("any", {"type": "tool", "name"}).

Thinking under a constraint: when the prompt leaves a reasoning block open (a Qwen template with
thinking on writes `<think>\\n`), the grammar lets the model think first (free text up to
`</think>`), then holds the answer to the tool call or the format. Turning thinking off instead
would answer a different prompt than the one the client asked for, and Qwen3.5-family models
call tools better after thinking; a client that wants no thinking says so with
chat_template_kwargs {"enable_thinking": false}, as without a constraint.
"""

from typing import Any, List, Optional

from speculative.constraints import Constraint, chosen_functions, combine, tool_call_constraint
from speculative.errors import DynoError
from speculative.loader import LoadedModel

from .parsers import ToolCallStream, tool_call_format
from .textstream import initial_channel


def calls_allowed(tools: Optional[List[dict]], choice: Any) -> bool:
    """True when the answer may call a tool: tools offered and tool_choice not none."""
    return bool(tools) and not (choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none"))


def check_tools(lm: LoadedModel, tools: Optional[List[dict]], choice: Any) -> None:
    """DynoError unless the model's template takes tools (when the answer may call one), each tool has
    a name, and a tool_choice that requires a call has tools to call."""
    if not tools:
        chosen_functions(tools, choice)  # "required" or a named tool without tools: an error
    if not calls_allowed(tools, choice):
        return
    chosen_functions(tools, "required")  # each tool names its function, with a schema object
    if tool_call_format(lm.tokenizer) is None:
        raise DynoError("invalid tools: this model's chat template has no tool calls")


def answer_constraint(lm: LoadedModel, prompt: List[int], tools: Optional[List[dict]], choice: Any,
                      parallel: bool = True, response: Optional[Constraint] = None,
                      strict: bool = False) -> Optional[Constraint]:
    """The grammar the answer follows, or None: the forced call of tool_choice required or named;
    else the response format, or either a call or that format when tools may be called; else, for
    `strict` tools, text or calls that follow their schemas. After the reasoning the prompt opened,
    if any (see the module docstring)."""
    allowed = calls_allowed(tools, choice)
    forced = allowed and chosen_functions(tools, choice) is not None
    strict = strict and allowed and response is None  # a forced call or a format already holds the arguments
    answers = []
    if forced or strict or (allowed and response is not None):
        format = tool_call_format(lm.tokenizer)
        if format is None or format.form is None:
            name = "none" if format is None else format.name
            raise DynoError(f"invalid tool_choice: a tool call cannot be enforced in this model's tool-call "
                            f"format ({name}); use tool_choice auto, without response_format or strict tools")
        answers.append(tool_call_constraint(tools, choice if forced else "required", lm, format.start + "\n",
                                            "\n" + format.end, parallel, format.form))
    if response is not None and not forced:  # a forced call is the whole answer: no message to format
        answers.append(response)
    if not answers:
        return None
    thinking = initial_channel(lm.tokenizer, prompt) == "reasoning"
    return combine(answers, lm, lm.tokenizer.think_end if thinking else None, optional=strict and not forced)


def tool_call_stream(lm: LoadedModel, tools: Optional[List[dict]], choice: Any,
                     parallel: bool = True) -> Optional[ToolCallStream]:
    """The parser of the answer's tool calls; None when it may not call one."""
    if not calls_allowed(tools, choice):
        return None
    return ToolCallStream.for_tokenizer(lm.tokenizer, tools, parallel)
