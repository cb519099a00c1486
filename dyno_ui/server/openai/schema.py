"""The OpenAI API as Dyno serves it: request and response types, and the mapping to the runtime's request.

Validation lives in the types (bounds as OpenAI documents them); the server turns a failed
validation into an OpenAI-shaped 400. Unknown fields are ignored and logged (server/fields.py);
fields OpenAI defines that Dyno does not implement are refused by name (REFUSED_CHAT, REFUSED_COMPLETION).
"""

import json
import time
import uuid
from typing import Annotated, Any, Callable, ClassVar, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_serializer, model_validator

from ...runtime import request as neutral
from ...runtime.errors import ApiError
from ...runtime.request import MAX_LOGPROBS, PENALTY_CONTEXT
from ..drafting import Copies, Drafted


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_response(err: ApiError) -> ErrorResponse:
    """The OpenAI error envelope for `err`."""
    return ErrorResponse(error=ErrorBody(message=err.message, type=err.kind, param=err.param, code=err.code))


# ---- requests ------------------------------------------------------------------------------


# OpenAI request fields Dyno does not implement: a request that sets one to anything but its no-op
# value gets a 400 naming it, instead of an answer that pretends the field was applied. Each entry
# is (the values that do nothing, why); null is always allowed. Lifting one (as logprobs was, once
# implemented) is deleting its line and adding the field to the request type.
Refusals = Dict[str, Tuple[Callable[[Any], bool], str]]
REFUSED_CHAT: Refusals = {
    "n": (lambda v: v == 1, "only n=1 is supported (one choice per request)"),
    "audio": (lambda v: False, "audio output is not supported"),
    "modalities": (lambda v: v == ["text"], 'only ["text"] is supported'),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "verbosity": (lambda v: False, "verbosity levels are not supported"),
    "functions": (lambda v: False, "the deprecated functions field is not supported; use tools"),
    "function_call": (lambda v: False, "the deprecated function_call field is not supported; use tool_choice"),
    "store": (lambda v: v == False, "this server stores no completions"),  # noqa: E712
}
REFUSED_COMPLETION: Refusals = {
    "n": (lambda v: v == 1, "only n=1 is supported (one choice per request)"),
    "best_of": (lambda v: v == 1, "only best_of=1 is supported"),
    "echo": (lambda v: v == False, "echo is not supported"),  # noqa: E712
    "suffix": (lambda v: v == "", "suffix (fill-in-the-middle) is not supported"),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: kept aside, logged (server/fields.py), unused
    REFUSED: ClassVar[Refusals] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        """A 400 naming the first field set that Dyno does not implement (ApiError passes through pydantic)."""
        if isinstance(data, dict):
            for name, (no_op, why) in cls.REFUSED.items():
                value = data.get(name)
                if value is not None and not _safe(no_op, value):
                    raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
        return data


def _safe(test: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(test(value))
    except Exception:  # a value the test cannot compare is not a no-op
        return False


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields chat and completions share; None means "the model's default"."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # -1 and 0 both mean "off" (vLLM and mlx-lm)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None  # any integer: reduced modulo 2**64, the range MLX's generator takes
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[Dict[str, float]] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    repetition_context_size: int = Field(PENALTY_CONTEXT, ge=1)
    draft: Optional[StrictBool] = None  # false: this request decodes without drafts (docs/server.md)
    copies: Copies = None  # drafts copied from the context (server/drafting.py)

    def stop_strings(self) -> List[str]:
        """`stop` as a list without empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def requested_logprobs(self) -> Optional[int]:
        """How many top alternatives each token's log-probability comes with; None: no logprobs."""
        return None

    def sampling(self) -> neutral.Sampling:
        """The sampling fields as the runtime takes them (top_k -1, vLLM's "off", as 0)."""
        return neutral.Sampling(
            max_tokens=self.requested_max_tokens(), temperature=self.temperature, top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k, min_p=self.min_p, seed=self.seed,
            logit_bias=self.logit_bias, repetition_penalty=self.repetition_penalty,
            penalty_context=self.repetition_context_size, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, logprobs=self.requested_logprobs())


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


class ImageUrl(_Request):
    url: str  # a data: URL (data:image/png;base64,...); http(s) only where the server fetches them
    detail: Optional[str] = None  # taken, not used: the image processor sizes the image itself


class ImagePart(_Request):
    type: Literal["image_url"] = "image_url"
    image_url: ImageUrl


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class FunctionCall(_Request):
    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"  # a JSON string (OpenAI); an object is taken too


class ToolCall(_Request):
    """A call in an assistant message of the history."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def call(self) -> neutral.ToolCall:
        """The call with its arguments as an object when they are a JSON object (Qwen3.5's template
        iterates over them), else as the string the client sent."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        return neutral.ToolCall(self.function.name, arguments, self.id)


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, List[ContentPart]]] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None  # assistant
    tool_call_id: Optional[str] = None  # tool
    name: Optional[str] = None  # tool (older clients name the function here)

    @model_validator(mode="before")
    @classmethod
    def _no_video(cls, data):
        """A video part is named in its 400 (pydantic's union error would not say why)."""
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            for part in data["content"]:
                if isinstance(part, dict) and part.get("type") in ("video_url", "video", "input_video"):
                    raise ValueError("video input is not supported; send images (image_url parts)")
        return data

    def message(self) -> neutral.Message:
        """The message with its content as one string, `developer` as `system` (newer OpenAI clients
        send it; Qwen templates know only system), an assistant's reasoning and tool calls, a tool
        result's call id and name."""
        parts = [] if isinstance(self.content, str) else self.content or []
        content = self.content if isinstance(self.content, str) else "".join(
            p.text if isinstance(p, TextPart) else neutral.IMAGE_PLACEHOLDER for p in parts)
        assistant, tool = self.role == "assistant", self.role == "tool"
        return neutral.Message(
            role="system" if self.role == "developer" else self.role, content=content,
            images=tuple(p.image_url.url for p in parts if isinstance(p, ImagePart)),
            reasoning=self.reasoning_content if assistant else None,
            tool_calls=tuple(c.call() for c in self.tool_calls or ()) if assistant else (),
            tool_call_id=(self.tool_call_id or None) if tool else None, name=(self.name or None) if tool else None)


class FunctionDef(_Request):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None  # with tool_choice auto, calls follow their schemas (a grammar)


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef

    def tool(self) -> neutral.Tool:
        f = self.function
        return neutral.Tool(f.name, f.description, f.parameters, strict=bool(f.strict))


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    REFUSED: ClassVar[Refusals] = REFUSED_CHAT
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[Dict[str, Any]] = None  # read by convert.format_spec (errors name it)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # OpenAI's bound
    # A thinking budget (neutral.EFFORT_BUDGETS); it does not turn thinking on or off, the template does.
    reasoning_effort: Optional[Literal[tuple(neutral.EFFORT_BUDGETS)]] = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # as OpenAI: alternatives only with logprobs on
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        return self

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def thinking_budget(self) -> Optional[int]:
        """The effort's thinking budget; None (high, or no effort): the server's default."""
        return None if self.reasoning_effort is None else neutral.EFFORT_BUDGETS[self.reasoning_effort]

    def choice(self) -> neutral.ToolChoice:
        """tool_choice, resolved: auto when not given (as OpenAI), a named function by its name."""
        if self.tool_choice is None:
            return neutral.ToolChoice()
        if isinstance(self.tool_choice, str):
            return neutral.ToolChoice(self.tool_choice)
        return neutral.ToolChoice.named(self.tool_choice.function.name)


class CompletionRequest(SamplingFields):
    REFUSED: ClassVar[Refusals] = REFUSED_COMPLETION
    prompt: Union[str, List[int], List[str]]
    # The number of top alternatives with each token's log-probability (0: the token's alone);
    # OpenAI allows up to 5 here, Dyno up to the chat bound.
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    def requested_logprobs(self) -> Optional[int]:
        return self.logprobs

    def prompt_text_or_ids(self) -> Union[str, List[int]]:
        """The single prompt: text, or token ids (a list of one string is accepted)."""
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ApiError(400, "prompt: only one prompt per request is supported", param="prompt")
            return p[0]
        return p


# ---- responses -----------------------------------------------------------------------------


class _OmitNone(BaseModel):
    """Drops fields that are None (OpenAI omits absent deltas and reasoning)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    """OpenAI usage counts; cached tokens are the prompt prefix reused from an earlier request."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class FunctionOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionOut


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: Optional[str] = ""  # null (kept) when the answer is only tool calls, as OpenAI sends it
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCallOut]] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k == "content"}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = []


class ChatLogprobs(BaseModel):
    """choices[].logprobs of a chat completion (or of one chunk): the tokens it delivered."""

    content: Optional[List[ChatTokenLogprob]] = None
    refusal: Optional[List[ChatTokenLogprob]] = None


class CompletionLogprobs(BaseModel):
    """choices[].logprobs of /v1/completions: parallel lists, one entry per token."""

    tokens: List[str] = []
    token_logprobs: List[float] = []
    top_logprobs: List[Dict[str, float]] = []
    text_offset: List[int] = []


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Optional[str]
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletion(Drafted):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class FunctionDelta(_OmitNone):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallChunk(_OmitNone):
    """A piece of a streamed call: index, id, type and name on its first chunk, then arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionDelta


class ChatDelta(_OmitNone):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCallChunk]] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionChunk(Drafted):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[CompletionLogprobs] = None


class Completion(Drafted):
    """Both the response and each streamed chunk of /v1/completions (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dyno"
    max_model_len: Optional[int] = None  # the model's context in tokens, named as vLLM names it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


def new_id(prefix: str) -> str:
    """A response id such as chatcmpl-3f2a...."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
