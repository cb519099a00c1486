"""OpenAI's Responses API (/v1/responses) as Dyno serves it: the request, its reading into the runtime's
neutral ChatRequest, and the Response object and stream events it answers with.

Unknown fields, here and in items and tools, are ignored and logged (server/fields.py: the field
policy, docs/server.md); fields OpenAI defines that Dyno cannot honour are refused by name
(REFUSED_RESPONSES). The server keeps nothing: `store` is accepted, `previous_response_id` is refused,
every request carries its whole input. `namespace` tools are flattened into their function tools,
named NAMESPACE__NAME for the model (the calls it returns carry `namespace` and `name` again);
hosted tools (web search, code interpreter, ...) run on OpenAI's side: they are left out.
"""

import time
import uuid
from typing import Any, ClassVar, Dict, List, Literal, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_serializer

from ...runtime import request as neutral
from ...runtime.errors import ApiError
from ...runtime.request import EFFORT_BUDGETS, JsonSchema
from ..drafting import Copies, Drafted
from ..errors import validation_error
from . import schema as chat

STATELESS = "this server keeps no responses; send the whole conversation as input"
REFUSED_RESPONSES: chat.Refusals = {
    "previous_response_id": (lambda v: False, STATELESS),
    "conversation": (lambda v: False, "this server keeps no conversations; send the whole conversation in input"),
    "background": (lambda v: v == False, "background responses are not supported"),  # noqa: E712
    "prompt": (lambda v: False, "stored prompts are not supported"),
    "max_tool_calls": (lambda v: False, "max_tool_calls is not supported"),
    "top_logprobs": (lambda v: v == 0, "log-probabilities are not supported here; use /v1/chat/completions"),
    "truncation": (lambda v: v == "disabled", 'only "disabled" is supported (the input is never shortened)'),
    "service_tier": (lambda v: v in ("auto", "default"), 'only "auto" and "default" are supported'),
    "include": (lambda v: all(i == "reasoning.encrypted_content" for i in v),
                "only reasoning.encrypted_content may be included (reasoning comes as plain text)"),
}
# reasoning.effort -> (the template's enable_thinking, the thinking budget): "none" turns thinking off.
EFFORTS = {"none": (False, None), **{effort: (None, budget) for effort, budget in EFFORT_BUDGETS.items()}}


class _Strict(chat._Request):
    model_config = ConfigDict(extra="allow")  # unknown fields are kept aside, logged, and not used


NAMESPACE_JOIN = "__"  # the model sees a namespace's tool as NAMESPACE__NAME (Codex's own MCP naming)


def flat_name(namespace: Optional[str], name: str) -> str:
    """The function name the model sees for `name` in `namespace`."""
    return f"{namespace}{NAMESPACE_JOIN}{name}" if namespace else name


def declared(model: BaseModel, **kw) -> dict:
    """`model` as a dict of its declared fields alone (the unknown ones a request sent are not echoed)."""
    return model.model_dump(include=set(type(model).model_fields), **kw)


def _checked(kind, value: Any, where: Sequence) -> Any:
    """`value` read as `kind`, its errors named from the request's root (input.2.content...)."""
    try:
        return kind.model_validate(value)
    except ValidationError as e:
        errors = [{**err, "loc": (*where, *err["loc"])} for err in e.errors()]
        raise validation_error(errors) from None


def _bad(where: Sequence, why: str) -> ApiError:
    param = ".".join(str(p) for p in where)
    return ApiError(400, f"{param}: {why}", param=param)


# ---- requests ------------------------------------------------------------------------------


class TextPart(_Strict):
    """input_text, or an earlier answer's output_text replayed."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[List[Any]] = None
    logprobs: Optional[List[Any]] = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Any  # a string or a list of text parts: read by text_of
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[str] = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    namespace: Optional[str] = None  # a call of a namespace's tool
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Any  # a string or a list of text parts: read by text_of
    id: Optional[str] = None
    status: Optional[str] = None


class SummaryPart(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningPart(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: List[SummaryPart] = []
    content: Optional[List[ReasoningPart]] = None
    id: Optional[str] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        """The reasoning as the template replays it: its text, else its summary."""
        return "".join(p.text for p in self.content) if self.content else "\n\n".join(p.text for p in self.summary)


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}
Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None  # OpenAI's default here is true: calls follow their schemas (a grammar)

    def tool(self) -> neutral.Tool:
        return neutral.Tool(self.name, self.description, self.parameters, strict=self.strict is not False)


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str
    namespace: Optional[str] = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(_Strict):
    REFUSED: ClassVar[chat.Refusals] = {"verbosity": (lambda v: False, "verbosity levels are not supported")}
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ReasoningConfig(_Strict):
    effort: Optional[Literal[tuple(EFFORTS)]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None  # the reasoning comes whole, as content
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class Namespace(_Strict):
    """A named group of function tools (MCP servers' tools, as Codex sends them)."""

    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    tools: List[Any] = []


# tool_choice types that force a tool OpenAI runs: a request forcing one cannot be answered here.
HOSTED_CHOICES = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use",
                  "computer_use_preview", "image_generation", "mcp", "local_shell", "shell", "apply_patch")


class StreamOptions(_Strict):
    include_obfuscation: Optional[bool] = None  # nothing to pad: Dyno sends no obfuscation field


class ResponsesRequest(_Strict):
    REFUSED: ClassVar[chat.Refusals] = REFUSED_RESPONSES
    model: Optional[str] = None
    input: Any  # a string or a list of items: read by items()
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None  # read by functions()
    tool_choice: Any = None  # read by choice()
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    draft: Optional[StrictBool] = None  # false: this request decodes without drafts (docs/server.md)
    copies: Copies = None  # drafts copied from the context (server/drafting.py)
    store: Optional[bool] = None  # accepted; nothing is kept either way
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # the prefix cache needs no key
    prompt_cache_retention: Optional[str] = None
    # Refused by name unless no-ops (REFUSED_RESPONSES):
    previous_response_id: Optional[Any] = None
    conversation: Optional[Any] = None
    background: Optional[Any] = None
    prompt: Optional[Any] = None
    max_tool_calls: Optional[Any] = None
    top_logprobs: Optional[Any] = None
    truncation: Optional[Any] = None
    service_tier: Optional[Any] = None
    include: Optional[List[str]] = None

    def items(self) -> List[Item]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        if not isinstance(self.input, list) or not self.input:
            raise _bad(("input",), "must be a string or a non-empty list of items")
        out = []
        for i, raw in enumerate(self.input):
            if not isinstance(raw, dict):
                raise _bad(("input", i), "must be an object (an input item)")
            kind = raw.get("type", "message" if "role" in raw else None)
            if kind not in ITEMS:
                known = ", ".join(ITEMS)
                raise _bad(("input", i, "type"), f"items of type {kind!r} are not supported (only {known})")
            out.append(_checked(ITEMS[kind], raw, ("input", i)))
        return out

    def tool_entries(self) -> List[Tuple[Tuple, FunctionTool, Optional[str]]]:
        """(where in the request, function tool, its namespace) for every function tool, those inside
        a namespace with their flat names; hosted tools are left out (hosted())."""
        out = []
        for i, raw in enumerate(self.tools or ()):
            if not isinstance(raw, dict):
                raise _bad(("tools", i), "must be an object (a tool)")
            if raw.get("type") == "namespace":
                space = _checked(Namespace, raw, ("tools", i))
                for j, inner in enumerate(space.tools):
                    where = ("tools", i, "tools", j)
                    if not isinstance(inner, dict) or inner.get("type", "function") != "function":
                        raise _bad((*where, "type"), "a namespace may hold only function tools here")
                    tool = _checked(FunctionTool, {"type": "function", **inner}, where)
                    tool.name = flat_name(space.name, tool.name)
                    out.append((where, tool, space.name))
            elif raw.get("type") == "function":
                out.append((("tools", i), _checked(FunctionTool, raw, ("tools", i)), None))
        return out

    def functions(self) -> List[FunctionTool]:
        """The function tools the model is offered, namespaces flattened."""
        return [tool for _, tool, _ in self.tool_entries()]

    def hosted(self) -> List[str]:
        """The types of the tools left out of the prompt: tools OpenAI runs on its side (web_search,
        file_search, code_interpreter, computer_use, ...), which a local model cannot call."""
        return [raw.get("type") for raw in self.tools or () if isinstance(raw, dict)
                and raw.get("type") not in ("function", "namespace")]

    def namespaces(self) -> Dict[str, Tuple[str, str]]:
        """A flat tool name -> (namespace, name) as the request gave them, to name the calls back."""
        return {tool.name: (space, tool.name[len(space) + len(NAMESPACE_JOIN):])
                for _, tool, space in self.tool_entries() if space}

    def parts(self) -> List[Tuple[Tuple, BaseModel]]:
        """The items and tools this type reads itself, with where they are (for the field policy)."""
        return [(("input", i), item) for i, item in enumerate(self.items())] + \
            [(where, tool) for where, tool, _ in self.tool_entries()]

    def choice(self) -> neutral.ToolChoice:
        if self.tool_choice is None:
            return neutral.ToolChoice()
        if self.tool_choice == "required" and self.hosted() and not self.functions():
            raise ApiError(400, f"tool_choice: \"required\" forces a call, and the only tools are hosted ones "
                                f"({', '.join(self.hosted())}), which run on OpenAI's side: this server cannot "
                                f"run them", param="tool_choice", code="unsupported_parameter")
        if self.tool_choice in ("auto", "none", "required"):
            return neutral.ToolChoice(self.tool_choice)
        if not isinstance(self.tool_choice, dict):
            raise _bad(("tool_choice",), 'must be "auto", "none", "required" or {"type": "function", "name": ...}')
        kind = self.tool_choice.get("type")
        if kind in self.hosted() or kind in HOSTED_CHOICES:
            raise ApiError(400, f"tool_choice: the hosted tool {kind!r} runs on OpenAI's side; this server "
                                f"cannot run it (offer a function tool instead)", param="tool_choice",
                           code="unsupported_parameter")
        if kind != "function":
            raise _bad(("tool_choice", "type"), f'must be "function" (a named function tool), got {kind!r}')
        named = _checked(NamedFunction, self.tool_choice, ("tool_choice",))
        return neutral.ToolChoice.named(flat_name(named.namespace, named.name))

    def format(self) -> Optional[JsonSchema]:
        """text.format as the JSON the answer follows (the grammar chat's response_format takes)."""
        spec = self.text.format if self.text else None
        if spec is None or spec.type == "text":
            return None
        if spec.type == "json_object":
            return JsonSchema()
        if spec.schema_ is None:
            raise _bad(("text", "format", "schema"), "a json_schema format needs a schema")
        return JsonSchema(spec.schema_)

    def effort(self) -> Tuple[Optional[bool], Optional[int]]:
        """(enable_thinking, thinking budget) for reasoning.effort; (None, None): the server's defaults."""
        effort = self.reasoning.effort if self.reasoning else None
        return (None, None) if effort is None else EFFORTS[effort]

    def chat_request(self) -> neutral.ChatRequest:
        """The request in the runtime's terms; ChatRequest as chat completions build it."""
        thinking, budget = self.effort()
        return neutral.ChatRequest(
            messages=messages(self.instructions, self.items()), model=self.model,
            tools=tuple(t.tool() for t in self.functions()), tool_choice=self.choice(),
            parallel_tool_calls=self.parallel_tool_calls is not False, response_format=self.format(),
            thinking=thinking, thinking_budget=budget, draft=self.draft, copies=self.copies,
            sampling=neutral.Sampling(max_tokens=self.max_output_tokens, temperature=self.temperature,
                                      top_p=self.top_p))


def text_of(content: Any, where: Sequence) -> str:
    """A message's content (or a call's output) as one string: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of input_text parts")
    parts = []
    for j, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in ("input_text", "output_text"):
            raise _bad((*where, j, "type"), f"only text content is supported, got {kind!r}")
        parts.append(_checked(TextPart, raw, (*where, j)).text)
    return "".join(parts)


def user_content(content: Any, where: Sequence) -> Tuple[str, Tuple[str, ...]]:
    """A user message's content: its text, an image placeholder where each input_image is, and the images' URLs."""
    if not isinstance(content, list):
        return text_of(content, where), ()
    text, images = [], []
    for j, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind == "input_image":
            url = raw.get("image_url")
            if not isinstance(url, str):
                raise _bad((*where, j, "image_url"), "must be a data: URL (file_id images are not supported)")
            text.append(neutral.IMAGE_PLACEHOLDER)
            images.append(url)
        elif kind in ("input_text", "output_text"):
            text.append(_checked(TextPart, raw, (*where, j)).text)
        else:
            raise _bad((*where, j, "type"), f"only text and image content is supported, got {kind!r}")
    return "".join(text), tuple(images)


def messages(instructions: Optional[str], items: List[Item]) -> Tuple[neutral.Message, ...]:
    """The conversation: `instructions` and the system or developer messages before the first other
    item as one system message (Qwen templates take a single system message, first); consecutive
    reasoning, assistant text and function calls as one assistant turn; each call output a tool result."""
    system = [instructions] if instructions else []
    out: List[neutral.Message] = []
    turn: Optional[dict] = None  # the assistant turn being gathered
    names: Dict[str, str] = {}  # call id -> function name, for the results

    def flush():
        nonlocal turn
        if turn is not None:
            out.append(neutral.Message("assistant", turn["content"], reasoning=turn["reasoning"],
                                       tool_calls=tuple(turn["calls"])))
            turn = None

    for i, item in enumerate(items):
        where = ("input", i, "content")
        if isinstance(item, MessageItem) and item.role in ("system", "developer") and not out and turn is None:
            system.append(text_of(item.content, where))
        elif isinstance(item, MessageItem) and item.role != "assistant":
            flush()
            content, images = user_content(item.content, where) if item.role == "user" else (
                text_of(item.content, where), ())
            out.append(neutral.Message("system" if item.role == "developer" else item.role, content, images=images))
        elif isinstance(item, FunctionCallOutputItem):
            flush()
            out.append(neutral.Message("tool", text_of(item.output, ("input", i, "output")),
                                       tool_call_id=item.call_id, name=names.get(item.call_id)))
        else:  # the assistant's: reasoning, text, calls
            if turn is not None and (turn["calls"] and not isinstance(item, FunctionCallItem)
                                     or isinstance(item, ReasoningItem) and turn["content"]):
                flush()  # a new step of the answer starts
            turn = turn or {"content": "", "reasoning": None, "calls": []}
            if isinstance(item, ReasoningItem):
                turn["reasoning"] = (turn["reasoning"] or "") + item.text()
            elif isinstance(item, MessageItem):
                turn["content"] += text_of(item.content, where)
            else:
                name = flat_name(item.namespace, item.name)  # as the model saw the tool
                names[item.call_id] = name
                call = chat.ToolCall(id=item.call_id, function=chat.FunctionCall(name=name,
                                                                                 arguments=item.arguments))
                turn["calls"].append(call.call())
    flush()
    head = (neutral.Message("system", "\n\n".join(system)),) if system else ()
    return head + tuple(out)


# ---- responses -----------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: List[Any] = []
    logprobs: List[Any] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "in_progress"
    content: List[OutputText] = []


class ReasoningOut(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: str = "in_progress"
    summary: List[Any] = []
    content: List[ReasoningText] = []


class FunctionCallOut(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: str = "in_progress"
    call_id: str
    name: str
    arguments: str = ""
    namespace: Optional[str] = None  # a namespace tool's call: left out when None, as OpenAI does

    @model_serializer(mode="wrap")
    def _without_empty_namespace(self, handler):
        out = handler(self)
        if out.get("namespace") is None:
            out.pop("namespace", None)
        return out


OutputItem = Union[MessageOut, ReasoningOut, FunctionCallOut]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # the prompt prefix reused from an earlier request
    cache_write_tokens: int = 0  # OpenAI's explicit prompt caching, which Dyno has not (its cache is implicit)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str


class ResponseError(BaseModel):
    code: str
    message: str


class Response(Drafted):
    """The Response object, with the request's settings echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str = "in_progress"  # completed, incomplete, failed
    completed_at: Optional[int] = None
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    model: str
    output: List[OutputItem] = []
    usage: Optional[Usage] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: Dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: Dict[str, Any] = {}
    store: bool = False
    temperature: Optional[float] = None
    text: Dict[str, Any] = {}
    tool_choice: Union[str, Dict[str, Any]] = "auto"
    tools: List[Dict[str, Any]] = []
    top_p: Optional[float] = None
    truncation: str = "disabled"
    user: Optional[str] = None
    background: bool = False


class Event(BaseModel):
    """A stream event: its type names the event, sequence_number counts them from 0."""

    type: str
    sequence_number: int = 0


class ResponseEvent(Event):  # response.created, .in_progress, .completed, .incomplete, .failed
    response: Response


class ItemEvent(Event):  # response.output_item.added, .done
    output_index: int
    item: OutputItem


class PartEvent(Event):  # response.content_part.added, .done
    item_id: str
    output_index: int
    content_index: int = 0
    part: Union[OutputText, ReasoningText]


class TextDeltaEvent(Event):  # response.output_text.delta
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: List[Any] = []


class TextDoneEvent(Event):  # response.output_text.done
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: List[Any] = []


class ReasoningDeltaEvent(Event):  # response.reasoning_text.delta
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningDoneEvent(Event):  # response.reasoning_text.done
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ArgumentsDeltaEvent(Event):  # response.function_call_arguments.delta
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Event):  # response.function_call_arguments.done
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(Event):  # error
    code: Optional[str] = None
    message: str
    param: Optional[str] = None


def new_id(prefix: str) -> str:
    """An id in OpenAI's Responses shape: resp_3f2a..., msg_..., fc_..., rs_...."""
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
