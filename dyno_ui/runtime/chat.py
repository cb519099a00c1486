"""A ChatRequest (runtime/request.py) becomes a job here, the same way for every API: pick the model,
check the tools, apply the chat template, compile the grammar the answer follows, set the thinking
budget, check the prompt against the context, and make the job that splits reasoning and parses tool
calls. System messages after the first are placed as the template allows (runtime/system_turns.py).

Errors are ApiErrors naming the field at fault (OpenAI's field names, as ApiError's other names).
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

from speculative.constraints import constraint_for
from speculative.loader import LoadedModel
from speculative.loader.vision import ProcessedImages, checked_vision, process_images
from speculative.thinking_budget import ThinkingBudget, budget_for

from .errors import bad_request
from .outputs import Finished, TextDelta, ToolCallDelta
from .images import request_images
from .request import ChatRequest, Message, ToolCall
from .served import ServedModel, chat_job, chat_prompt, checked_sampling, draft_spec
from .system_turns import place_system_turns
from .tools import answer_constraint, check_tools, template_tools, tool_call_stream
from .worker import Job


@dataclass(frozen=True)
class Prompt:
    """A request's prompt: the model it goes to and its token ids."""

    model: str  # the served model's id
    lm: LoadedModel
    tokens: List[int]
    images: Optional[ProcessedImages] = None  # its images, processed (the engine thread runs the tower)


def prompt_for(served: ServedModel, request: ChatRequest) -> Prompt:
    """Pick the model, check the tools, and apply the chat template (with the tools when they may be called)."""
    model_id, lm = served.current(request.model)  # one model for the whole request, even across a swap
    with bad_request("tools"):
        check_tools(lm, request)
    kwargs = dict(request.template_kwargs)
    if request.thinking is not None:
        kwargs["enable_thinking"] = request.thinking
    messages = place_system_turns(lm.tokenizer, [template_message(m) for m in request.messages])
    urls = [u for m in request.messages for u in m.images]
    if urls:
        with bad_request("messages"):  # before anything is fetched or decoded
            vision = checked_vision(lm)
    tokens = chat_prompt(lm, messages, kwargs, template_tools(request), request.prefill)
    if not urls:
        return Prompt(model_id, lm, tokens)
    with bad_request("messages"):
        tokens, images = process_images(vision, tokens, request_images(urls, served.images), served.images.limits)
    return Prompt(model_id, lm, tokens, images)


def job_for(served: ServedModel, request: ChatRequest, sink) -> Tuple[str, Job]:
    """(served model id, job) for `request`: the templated prompt, the answer held to a forced call or
    the response format (after any reasoning the template opened), thinking held to its budget, tool
    calls parsed."""
    prompt = prompt_for(served, request)
    lm = prompt.lm
    with bad_request("response_format"):
        response = None if request.response_format is None else constraint_for(request.response_format, lm)
    with bad_request("tool_choice"):
        constraint = answer_constraint(lm, prompt.tokens, request, response)
    budget = thinking_budget(served, request, prompt)
    params = checked_sampling(lm, prompt.tokens, "messages", request.sampling, served.default_max_tokens,
                              constraint, budget)
    watch = ThinkingOnly(getattr(served.worker, "metrics", None), sink)  # (no worker: a job built to be looked at)
    job = chat_job(lm, prompt.tokens, params, list(request.stop), watch.sink, tool_calls=tool_call_stream(lm, request),
                   images=prompt.images, spec=draft_spec(request.draft), copies=request.copies)
    watch.job = job
    return prompt.model, job


class ThinkingOnly:
    """Passes a job's outputs on, and counts the answer in /stats when it ends inside its think block
    with no visible text (max_tokens spent thinking): the client got reasoning and nothing else."""

    def __init__(self, metrics, sink):
        self.metrics, self.downstream = metrics, sink
        self.job: Optional[Job] = None
        self.visible = False

    def sink(self, item) -> None:
        """Called on the engine thread, as the job's own sink."""
        if isinstance(item, ToolCallDelta) or (isinstance(item, TextDelta) and item.channel == "content"
                                               and item.text.strip()):
            self.visible = True
        elif (isinstance(item, Finished) and item.finish_reason != "cancelled" and not self.visible
              and self.job is not None and self.job.text.where == "reasoning" and self.metrics is not None):
            self.metrics.record_thinking_only()
        self.downstream(item)


def thinking_budget(served: ServedModel, request: ChatRequest, prompt: Prompt) -> Optional[ThinkingBudget]:
    """The request's thinking budget, else the server's (--reasoning-budget); None when neither sets
    one or the model has no single-token think tags to count between."""
    budget = request.thinking_budget if request.thinking_budget is not None else served.reasoning_budget
    if budget is None:
        return None
    with bad_request("thinking_budget"):
        return budget_for(prompt.lm, budget, prompt.tokens)


def template_message(message: Message) -> dict:
    """A message as chat templates take it (Hugging Face's convention, which Qwen's templates read)."""
    out = {"role": message.role, "content": message.content}
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [_template_call(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _template_call(call: ToolCall) -> dict:
    function = {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return function if call.id is None else {"id": call.id, **function}
