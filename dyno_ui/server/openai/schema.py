"""The OpenAI API as Dyno serves it: request and response types, and the mapping to SamplingParams.

Validation lives in the types (bounds as OpenAI documents them); the server turns a failed
validation into an OpenAI-shaped 400. Unknown fields are ignored, as OpenAI-compatible servers do.
"""

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from speculative.config import PENALTY_CONTEXT, SamplingParams

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


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


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
    n: int = Field(1, ge=1, le=1)  # one choice per request
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

    def sampling(self, generation_config: dict, default_max_tokens: int, room: int, vocab: int) -> SamplingParams:
        """SamplingParams: request values over generation_config over greedy; `room` caps max_tokens."""
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


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, List[TextPart]]] = None
    reasoning_content: Optional[str] = None

    def for_template(self) -> dict:
        """The message as chat templates expect it: content as one string, `developer` as `system`
        (newer OpenAI clients send it; Qwen templates know only system), reasoning kept for the template."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.reasoning_content is not None and self.role == "assistant":
            message["reasoning_content"] = self.reasoning_content
        return message


class ChatCompletionRequest(SamplingFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: Union[str, List[int], List[str]]

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


class ChatMessageOut(_OmitNone):
    role: str = "assistant"
    content: Optional[str] = ""
    reasoning_content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Optional[str]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class ChatDelta(_OmitNone):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: None = None


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
    logprobs: None = None


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
