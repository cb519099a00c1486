"""The Anthropic Messages API as Dyno serves it: request types, response and stream-event types, errors.

Validation lives in the types (ranges as Anthropic documents them); the server turns a failed
validation into an Anthropic-shaped 400. Content a local model cannot take (documents, tools whose
schemas only Claude knows, MCP servers) is a 400 naming it, never dropped; server tools (web search,
web fetch, code execution: they run on Anthropic's side) are left out, as the Responses API's hosted
tools are, unless the request forces one. Hints with nothing to do here
(`cache_control`: prefixes are reused anyway; `metadata`, `service_tier`) are accepted and ignored.
"""

import uuid
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, model_validator

from ...runtime.errors import ApiError
from ..drafting import Copies, Drafted

# ---- errors --------------------------------------------------------------------------------

# Anthropic's error types by HTTP status (503 is ours: a model loading or the server stopping).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    """The error envelope, also the `error` event of a stream."""

    type: Literal["error"] = "error"
    error: ErrorDetail


def error_response(err: ApiError) -> ErrorResponse:
    """The Anthropic error envelope for `err` (its type from the status)."""
    kind = ERROR_TYPES.get(err.status) or ("invalid_request_error" if err.status < 500 else "api_error")
    return ErrorResponse(error=ErrorDetail(type=kind, message=err.message))


# ---- requests ------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: kept aside, logged (server/fields.py), unused
    cache_control: Optional[Dict[str, Any]] = None  # on blocks, tools, system: prefixes are reused anyway


class TextBlock(_Request):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Dict[str, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, List[TextBlock]] = ""
    is_error: bool = False  # the content carries the error message; the template has no other place for it

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ImageSource(_Request):
    type: Literal["base64", "url"]
    media_type: Optional[str] = None  # base64: image/png, image/jpeg, image/webp or image/gif
    data: Optional[str] = None  # base64
    url: Optional[str] = None  # url: fetched only where the server allows it

    def as_url(self) -> str:
        """The image as a URL: base64 data as a data: URL."""
        if self.type == "url":
            return self.url or ""
        return f"data:{self.media_type or ''};base64,{self.data or ''}"


class ImageBlock(_Request):
    type: Literal["image"] = "image"
    source: ImageSource


class ThinkingBlock(_Request):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]
BLOCKS = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
          "system": ("text",)}
ROLES = ("user", "assistant", "system")
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def role_refusal(index: int, role: Any) -> ApiError:
    """A role this API does not know, worded as Anthropic's API words it."""
    return ApiError(400, f'messages.{index}: Unexpected role "{role}". Allowed roles are "user", "assistant" '
                         f'or "system"', param=f"messages.{index}.role")


def system_refusal(index: int, kind: Any) -> ApiError:
    """A system message this server cannot place, worded as Anthropic's API refuses a system role
    (Claude Code recognises "role 'system' is not supported" and sends the conversation again without it)."""
    return ApiError(400, f"messages.{index}: role 'system' is not supported on this model with content blocks "
                         f"of type {kind!r} (this server takes text blocks there)", param=f"messages.{index}.content")


class TurnConfig(_Request):
    """A system message's own output_config: the effort for the turn it belongs to."""

    effort: Optional[Literal[EFFORTS]] = None


class Message(_Request):
    role: Literal[ROLES]
    content: Union[str, List[Block]]
    # A system message's own fields (Anthropic's): shown only until the next user message, or always;
    # and the effort of its turn.
    clear_at: Optional[Literal["next_user_message", "never"]] = None
    output_config: Optional[TurnConfig] = None

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data):
        """A block this server cannot take is named, not dropped (pydantic's union error would not say why)."""
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            allowed = BLOCKS.get(data.get("role"), ())
            for block in data["content"]:
                kind = block.get("type") if isinstance(block, dict) else None
                if allowed and kind not in allowed:
                    raise ValueError(f"content block type {kind!r} is not supported in a {data['role']} message "
                                     f"(this server takes {', '.join(allowed)})")
        return data

    def blocks(self) -> List[BaseModel]:
        return [TextBlock(text=self.content)] if isinstance(self.content, str) else list(self.content)

    def text(self) -> str:
        """A system message's text: its blocks joined as the top-level `system`'s are."""
        return "".join(b.text for b in self.blocks())


class Tool(_Request):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: Dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data):
        """Anthropic's own tools (web search, bash, text editor, ...) run on Anthropic's side or carry
        schemas only Claude knows: a local model can take only tools described by a schema."""
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is not supported: only custom tools (name, description, "
                             f"input_schema)")
        return data


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's name")
        return self

    @property
    def forced(self) -> bool:
        """True when the answer must be a tool call (any, or a named tool)."""
        return self.type in ("any", "tool")


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive"]  # adaptive: as the chat template decides by default
    budget_tokens: Optional[int] = Field(None, ge=1)  # with enabled: the thinking budget (None: the server's)


class JsonFormat(_Request):
    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: Optional[JsonFormat] = None  # structured output: the answer is JSON valid against the schema
    effort: Optional[Literal[EFFORTS]] = None  # the thinking budget (convert.EFFORT_BUDGETS)


# Tools that run on Anthropic's side (their types carry a date: web_search_20250305, ...).
SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


class Conversation(_Request):
    """What both /v1/messages and /v1/messages/count_tokens read: the prompt and the tools."""

    model: str
    messages: List[Message] = Field(min_length=1)
    system: Optional[Union[str, List[TextBlock]]] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    _server_tools: List[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _server_tools_left_out(cls, data, handler):
        """Server tools are not the model's to call here: out of `tools`, their names kept (server_tools)."""
        left = []
        if isinstance(data, dict) and isinstance(data.get("tools"), list):
            kept = []
            for tool in data["tools"]:
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind.startswith(SERVER_TOOLS):
                    left.append(str(tool.get("name") or kind))
                else:
                    kept.append(tool)
            data = {**data, "tools": kept}
        out = handler(data)
        out._server_tools = left
        return out

    @property
    def server_tools(self) -> List[str]:
        """The names of the server tools the request offered, left out of the prompt."""
        return self._server_tools

    @model_validator(mode="before")
    @classmethod
    def _no_server_side_features(cls, data):
        for name in ("mcp_servers", "container"):
            if isinstance(data, dict) and data.get(name):
                raise ValueError(f"{name} is not supported by this server")
        return data

    @model_validator(mode="before")
    @classmethod
    def _known_roles(cls, data):
        """Roles and system messages refused in Anthropic's words (ApiError passes through pydantic)."""
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            if not isinstance(message, dict) or "role" not in message:
                continue
            if message["role"] not in ROLES:
                raise role_refusal(i, message["role"])
            content = message.get("content")
            if message["role"] == "system" and isinstance(content, list):
                for block in content:
                    kind = block.get("type") if isinstance(block, dict) else None
                    if kind != "text":
                        raise system_refusal(i, kind)
        return data

    @property
    def output_schema(self) -> Optional[Dict[str, Any]]:
        """The JSON schema output_config.format asks the answer to follow, if any."""
        fmt = self.output_config.format if self.output_config else None
        return fmt.schema_ if fmt else None

    def system_text(self) -> Optional[str]:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(b.text for b in self.system)


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)  # 0: off
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    metadata: Optional[Dict[str, Any]] = None  # accepted; nothing to do with it locally
    draft: Optional[StrictBool] = None  # false: this request decodes without drafts (docs/server.md)
    copies: Copies = None  # drafts copied from the context (server/drafting.py)

    def stop_strings(self) -> List[str]:
        return [s for s in self.stop_sequences or [] if s]


class CountTokensRequest(Conversation):
    pass


# ---- responses -----------------------------------------------------------------------------


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its thinking; a local model has nothing to sign it with


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Dict[str, Any]


ContentOut = Union[TextOut, ThinkingOut, ToolUseOut]


class Usage(BaseModel):
    """Token counts as Anthropic reports them: input_tokens excludes the prompt tokens reused from an
    earlier request (cache_read_input_tokens); the prompt is their sum."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageOut(Drafted):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: List[ContentOut]
    stop_reason: Optional[str] = None  # end_turn, max_tokens, stop_sequence, tool_use
    stop_sequence: Optional[str] = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class ModelInfo(BaseModel):
    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str  # RFC 3339


class ModelPage(BaseModel):
    """GET /v1/models as Anthropic's clients read it: one page, with the ids that bound it."""

    data: List[ModelInfo]
    has_more: bool
    first_id: Optional[str]
    last_id: Optional[str]


# ---- stream events -------------------------------------------------------------------------


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageOut


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentOut


class TextDeltaOut(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDeltaOut(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDeltaOut(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Union[TextDeltaOut, ThinkingDeltaOut, InputJsonDeltaOut]


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: Optional[str]
    stop_sequence: Optional[str] = None


class MessageDelta(Drafted):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: Usage  # cumulative: clients overwrite the counts message_start gave


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


Event = Union[MessageStart, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta, MessageStop,
              ErrorResponse]


def new_id(prefix: str) -> str:
    """An id such as msg_3f2a... or toolu_3f2a..."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
