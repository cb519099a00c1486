"""The OpenAI API as Dyno serves it: request and response types, and the mapping to SamplingParams.

Validation lives in the types (bounds as OpenAI documents them); the server turns a failed
validation into an OpenAI-shaped 400. Unknown fields are ignored, as OpenAI-compatible servers do;
fields OpenAI defines that Dyno does not implement are refused by name (REFUSED_CHAT, REFUSED_COMPLETION).
"""

import json
import time
import uuid
from typing import Any, Callable, ClassVar, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from speculative.config import MAX_LOGPROBS, PENALTY_CONTEXT, SamplingParams

from ...runtime.errors import ApiError


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
THINKING_HINT = 'turn thinking off with chat_template_kwargs {"enable_thinking": false}'
REFUSED_CHAT: Refusals = {
    "n": (lambda v: v == 1, "only n=1 is supported (one choice per request)"),
    "audio": (lambda v: False, "audio output is not supported"),
    "modalities": (lambda v: v == ["text"], 'only ["text"] is supported'),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "reasoning_effort": (lambda v: False, f"reasoning effort levels are not supported; {THINKING_HINT}"),
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
    model_config = ConfigDict(extra="ignore")
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

    def sampling(self, generation_config: dict, default_max_tokens: int, room: int, vocab: int,
                 constraint=None) -> SamplingParams:
        """SamplingParams: request values over generation_config over greedy; `room` caps max_tokens;
        `constraint` the grammar the answer follows (speculative.constraints), if any."""
        wanted = self.requested_max_tokens() or default_max_tokens
        return SamplingParams.from_generation_config(
            generation_config, temperature=self.temperature, top_p=self.top_p, min_p=self.min_p,
            top_k=0 if self.top_k == -1 else self.top_k, max_tokens=min(wanted, room), seed=self.seed,
            logit_bias=_token_biases(self.logit_bias, vocab),
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty or 0.0,
            presence_context_size=self.repetition_context_size,
            frequency_penalty=self.frequency_penalty or 0.0,
            frequency_context_size=self.repetition_context_size,
            constraint=constraint, logprobs=self.requested_logprobs(),
        )


def _token_biases(logit_bias: Optional[Dict[str, float]], vocab: int) -> Optional[Dict[int, float]]:
    """OpenAI's {"token id": bias} with ids checked against the vocabulary and biases in [-100, 100]."""
    if not logit_bias:
        return None
    out = {}
    for key, bias in logit_bias.items():
        if not (key.strip().isascii() and key.strip().isdigit()) or int(key) >= vocab:  # "²".isdigit()
            raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})",
                           param="logit_bias")
        if not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias: bias for token {key} must be in [-100, 100], got {bias}",
                           param="logit_bias")
        out[int(key)] = float(bias)
    return out


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(_Request):
    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"  # a JSON string (OpenAI); an object is taken too


class ToolCall(_Request):
    """A call in an assistant message of the history."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """The call as chat templates read it: arguments as an object when they are a JSON object
        (Qwen3.5's template iterates over them), else as the string the client sent."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return {"id": self.id, **call} if self.id is not None else call


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, List[TextPart]]] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None  # assistant
    tool_call_id: Optional[str] = None  # tool
    name: Optional[str] = None  # tool (older clients name the function here)

    def for_template(self) -> dict:
        """The message as chat templates expect it: content as one string, `developer` as `system`
        (newer OpenAI clients send it; Qwen templates know only system), reasoning and tool calls
        kept for the template, a tool result with its call's id."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.reasoning_content is not None and self.role == "assistant":
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls and self.role == "assistant":
            message["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.role == "tool":
            message.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v})
        return message


class FunctionDef(_Request):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None  # with tool_choice auto, calls follow their schemas (a grammar)


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef

    def for_template(self) -> dict:
        """The tool as chat templates render it (and as the constraints read it)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


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
    response_format: Optional[Dict[str, Any]] = None  # read by speculative.constraints (errors name it)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # OpenAI's bound

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # as OpenAI: alternatives only with logprobs on
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        return self

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_tools(self) -> Optional[List[dict]]:
        """The tools as the chat template and the constraints take them; None without tools."""
        return [t.for_template() for t in self.tools] if self.tools else None

    def strict_tools(self) -> bool:
        """True when a tool asks for strict arguments (OpenAI's function.strict)."""
        return any(t.function.strict for t in self.tools or ())

    def choice(self) -> Optional[Union[str, dict]]:
        """tool_choice as speculative.constraints reads it ("auto" when tools come without one, as OpenAI)."""
        if self.tool_choice is None:
            return "auto" if self.tools else None
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()


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


class ChatCompletion(BaseModel):
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


class ChatCompletionChunk(BaseModel):
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


class Completion(BaseModel):
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


def new_id(prefix: str) -> str:
    """A response id such as chatcmpl-3f2a...."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
