"""A chat request as every API hands it to the runtime (runtime/chat.py): plain values, no wire shapes.

Each API translates its own request into a ChatRequest once: its messages, its tools, its tool
choice resolved to a ToolChoice, its response format to a JsonSchema, its sampling fields to a
Sampling. What a ChatRequest holds is what the chat template, the grammar and the sampler need.
"""

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

from speculative.config import MAX_LOGPROBS, PENALTY_CONTEXT
from speculative.constraints import JsonSchema

__all__ = ["MAX_LOGPROBS", "PENALTY_CONTEXT", "JsonSchema", "ToolCall", "Message", "Tool", "ToolChoice",
           "Sampling", "ChatRequest", "EFFORT_BUDGETS", "IMAGE_PLACEHOLDER"]

# Where an image sits in a message's text: what Qwen3.5's chat template renders for an image part.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# Thinking tokens for an OpenAI reasoning effort (`reasoning_effort`, `reasoning.effort`); None: unlimited.
EFFORT_BUDGETS = {"minimal": 0, "low": 512, "medium": 2048, "high": None}


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made earlier in the conversation."""

    name: str
    arguments: Any  # an object, or the text the client sent when it is not a JSON object
    id: Optional[str] = None


@dataclass(frozen=True)
class Message:
    """One turn of the conversation."""

    role: str  # system, user, assistant or tool
    content: str
    reasoning: Optional[str] = None  # an assistant's reasoning, as the template replays it
    tool_calls: Tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool result: the call it answers
    name: Optional[str] = None  # a tool result: the tool's name, where the client gives it
    images: Tuple[str, ...] = ()  # its images as URLs (data: or http(s)), one IMAGE_PLACEHOLDER each in content


@dataclass(frozen=True)
class Tool:
    """A tool the model may call."""

    name: str
    description: Optional[str] = None  # None: the template is not given one
    parameters: Optional[Mapping[str, Any]] = None  # JSON schema of the arguments; None: no schema given
    strict: bool = False  # calls follow the schema even when the model may also answer in text


TOOL_CHOICES = ("auto", "none", "required", "named")


@dataclass(frozen=True)
class ToolChoice:
    """Whether the answer may call a tool (auto), must not (none), must call one (required) or the
    one named (named)."""

    mode: str = "auto"
    name: Optional[str] = None  # the tool a named choice forces

    def __post_init__(self):
        if self.mode not in TOOL_CHOICES or (self.mode == "named") != (self.name is not None):
            raise ValueError(f"tool choice {self.mode!r} with name {self.name!r}")

    @classmethod
    def named(cls, name: str) -> "ToolChoice":
        return cls("named", name)

    @property
    def forced(self) -> bool:
        """True when the answer must be a tool call."""
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class Sampling:
    """How to sample; None: the model's generation_config (then greedy). max_tokens None: the server's default."""

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # 0: off
    min_p: Optional[float] = None
    seed: Optional[int] = None
    logit_bias: Optional[Mapping[str, float]] = None  # token id, as JSON writes an object's keys -> bias
    repetition_penalty: Optional[float] = None
    penalty_context: int = PENALTY_CONTEXT  # tokens the repetition, presence and frequency penalties look at
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Optional[int] = None  # top alternatives with each token's log-probability; None: none


@dataclass(frozen=True)
class ChatRequest:
    """A conversation to answer, and how."""

    messages: Tuple[Message, ...]
    model: Optional[str] = None  # the id the request names; None: whichever is served
    tools: Tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    response_format: Optional[JsonSchema] = None  # the answer's JSON, unless it calls a tool
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more chat template arguments
    thinking: Optional[bool] = None  # the template's enable_thinking; None: the template's default
    thinking_budget: Optional[int] = None  # most tokens inside <think> before it is closed; None: the server's
    prefill: str = ""  # the answer's start, which the model continues
    sampling: Sampling = Sampling()
    stop: Tuple[str, ...] = ()
    draft: Optional[bool] = None  # False: no drafting for this request; None or True: the server's
    copies: Optional[str] = None  # drafts copied from the context: on, off or only; None: the server's

    @property
    def calls_allowed(self) -> bool:
        """True when the answer may call a tool: tools offered and a tool choice other than none."""
        return bool(self.tools) and self.tool_choice.mode != "none"
