"""The model a server serves, and the steps every request takes to become a job: pick the model,
apply the chat template, check the prompt against the context, sample (runtime/chat.py puts a chat
request through them)."""

import threading
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from speculative.config import SamplingParams, SpecConfig
from speculative.errors import DynoError, one_line
from speculative.loader import LoadedModel

from .errors import ApiError
from .images import ImagePolicy
from .parsers import ToolCallStream
from .request import Sampling
from .textstream import TextAssembler, initial_channel
from .worker import EngineWorker, Job

# Template arguments that would change what apply_chat_template returns (token ids) or how.
# `chat_template` too: a client's own Jinja template could run unbounded on the server.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "chat_template", "tokenize", "add_generation_prompt", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs", "tools",
})


@dataclass
class ServedModel:
    """The one model a server serves: its name, its limits, and the worker that runs it."""

    id: str
    lm: LoadedModel
    worker: EngineWorker
    default_max_tokens: int
    created: int
    loading: Optional[str] = None  # the model being loaded in its place (the Models tab), if any
    names: Tuple[str, ...] = ()  # --served-model-name: more ids requests may use for whichever model is served
    reasoning_budget: Optional[int] = None  # --reasoning-budget: thinking tokens for chat requests that set none
    images: ImagePolicy = ImagePolicy()  # image limits, and whether image URLs are fetched (--allow-image-urls)
    _swap: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def replace(self, lm: LoadedModel) -> None:
        """Serve `lm` (named as typed: repo id or folder name) from now on; the worker already runs it,
        and frees the old model's buffers once this reference to it is gone."""
        with self._swap:
            self.lm, self.id = lm, lm.name
        self.worker.release_memory()

    @property
    def ids(self) -> List[str]:
        """Every id a request may name: the served model's name, then the --served-model-name ones."""
        return [self.id] + [n for n in self.names if n != self.id]

    def current(self, requested: Optional[str]) -> Tuple[str, LoadedModel]:
        """The model a request goes to: none loading, and it names this one (or none); id and model
        are read together, so a request never names one model and gets another."""
        if self.loading is not None:
            raise ApiError(503, f"model loading: {self.loading}; send the request again when it is "
                                f"loaded", code="model_loading", kind="server_error")
        with self._swap:
            served_id, lm = self.id, self.lm
        if requested is not None and requested != served_id and requested not in self.names:
            raise self.not_found(requested)
        return served_id, lm

    def not_found(self, requested: str) -> ApiError:
        """The 404 for a model id this server does not serve, listing the ids it does."""
        return ApiError(404, f"The model '{requested}' does not exist; this server serves {quoted(self.ids)}",
                        param="model", code="model_not_found")

    def defaults(self, lm: Optional[LoadedModel] = None) -> SamplingParams:
        """The model's generation_config sampling values (greedy where it has none)."""
        return SamplingParams.from_generation_config((lm or self.lm).generation_config,
                                                     max_tokens=self.default_max_tokens)


def quoted(ids: Sequence[str]) -> str:
    """'a', 'b': model ids as the error messages list them."""
    return ", ".join(f"'{i}'" for i in ids)


def chat_prompt(lm: LoadedModel, messages: List[dict], template_kwargs: Optional[dict],
                tools: Optional[List[dict]] = None, prefill: str = "") -> List[int]:
    """Token ids of `messages` (and the `tools` offered) through the tokenizer's chat template, ready for the
    answer; `prefill`: the answer's start, written after the template's generation prompt (the answer
    continues it)."""
    kwargs = template_kwargs or {}
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs)):
        raise ApiError(400, f"chat_template_kwargs: {reserved[0]!r} is set by the server",
                       param="chat_template_kwargs")
    if tools:
        kwargs = {**kwargs, "tools": tools}
    try:
        if not prefill:
            return list(lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         **kwargs))
        text = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # jinja errors, bad kwargs: the request's fault
        raise ApiError(400, f"cannot apply the chat template: {one_line(e)}", param="messages") from None
    # One string, tokenized as the template's own tokens are: the prefill's first token may merge
    # with the prompt's last, as it would in a prompt written out whole.
    return list(lm.tokenizer.encode(text + prefill, add_special_tokens=False))


def sampling_params(sampling: Sampling, generation_config: Mapping, default_max_tokens: int, room: int,
                    vocab: int, constraint=None, thinking_budget=None) -> SamplingParams:
    """SamplingParams: the request's values over generation_config over greedy; max_tokens (the
    server's default when not given) capped by `room`; `constraint` the grammar the answer follows,
    `thinking_budget` the limit on its think block (speculative.thinking_budget)."""
    wanted = sampling.max_tokens or default_max_tokens
    context = sampling.penalty_context
    return SamplingParams.from_generation_config(
        generation_config, temperature=sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p,
        top_k=sampling.top_k, max_tokens=min(wanted, room), seed=sampling.seed,
        logit_bias=_token_biases(sampling.logit_bias, vocab), repetition_penalty=sampling.repetition_penalty,
        repetition_context_size=context, presence_penalty=sampling.presence_penalty, presence_context_size=context,
        frequency_penalty=sampling.frequency_penalty, frequency_context_size=context,
        constraint=constraint, thinking_budget=thinking_budget, logprobs=sampling.logprobs,
    )


def _token_biases(logit_bias: Optional[Mapping[str, float]], vocab: int) -> Optional[Dict[int, float]]:
    """{"token id": bias} with ids checked against the vocabulary and biases in [-100, 100]."""
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


def checked_sampling(lm: LoadedModel, prompt: Sequence[int], field: str, sampling: Sampling,
                     default_max_tokens: int, constraint=None, thinking_budget=None) -> SamplingParams:
    """SamplingParams (sampling_params) for a prompt that fits: not empty, shorter than the context."""
    n, limit = len(prompt), lm.context_length
    if n == 0:
        raise ApiError(400, f"{field}: the prompt is empty", param=field)
    if n >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens, but the "
                            f"prompt has {n} tokens", param=field, code="context_length_exceeded")
    try:
        return sampling_params(sampling, lm.generation_config, default_max_tokens, limit - n, lm.vocab_size,
                               constraint, thinking_budget)
    except DynoError as e:
        raise ApiError(400, e.message) from None


# A request's `draft: false`: decoded without drafts (serial: plain decoding; in a batch: its row pinned
# at depth 0), the same tokens as with them.
NO_DRAFTS = SpecConfig("off")


def draft_spec(draft: Optional[bool]) -> Optional[SpecConfig]:
    """The job's own SpecConfig for a request's `draft` field; None: the server's."""
    return NO_DRAFTS if draft is False else None


def chat_job(lm: LoadedModel, prompt: List[int], params: SamplingParams, stops: List[str], sink,
             tool_calls: Optional[ToolCallStream] = None, **job) -> Job:
    """A job for a templated chat prompt: reasoning split on, starting in the channel the template opened,
    tool calls parsed by `tool_calls` (runtime/tools.py makes it); `job` sets other Job fields (spec, trace)."""
    text = TextAssembler(lm.tokenizer, stops, split_reasoning=True, initial=initial_channel(lm.tokenizer, prompt),
                         tool_calls=tool_calls)
    return Job(list(prompt), params, text, sink, lm=lm, **job)


def completion_job(lm: LoadedModel, prompt: List[int], params: SamplingParams, stops: List[str], sink,
                   draft: Optional[bool] = None, copies: Optional[str] = None) -> Job:
    """A job for a raw prompt: no template, no reasoning split; `draft` False: no drafting; `copies`:
    its drafts' source (None: the server's)."""
    return Job(list(prompt), params, TextAssembler(lm.tokenizer, stops), sink, lm=lm, spec=draft_spec(draft),
               copies=copies)
