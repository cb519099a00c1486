"""`dyno serve` through the official openai client over a real socket: exact text, streams, counters."""

import json

import pytest

from helpers.reference import plain_greedy
from dyno_ui import cli
from dyno_ui.runtime.served import sampling_params
from dyno_ui.server.openai.schema import ChatCompletionRequest
from helpers.serving import MODEL_ID, detokenize, running_server, split_think
from helpers.tiny_models import with_chat_template
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.stats import GenerationStats

pytestmark = pytest.mark.e2e

CODE = "class Stack:\n    def push(self, item):\n"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack, please."}]
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_dir):
    with running_server(tiny_dir(), SpecConfig("auto", 3)) as running:
        yield running


def chat_prompt(lm, messages):
    return lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def thinking_prompt(lm, messages, opening):
    """Token ids of the thinking template: the plain template's text, then the think opening."""
    text = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return lm.tokenizer.encode(text + opening, add_special_tokens=False)


def stream_text(chunks, field="content"):
    """Concatenated deltas of one field, the finish reason and the usage chunk of a chat stream."""
    text, finish, usage = [], None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append(getattr(choice.delta, field, None) or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL_ID]
    assert server.get("/health").json() == {"status": "ok", "model": MODEL_ID}
    head = server.stats()["mtp_head"]  # a float trunk: the head stays as stored
    assert head == {**server.served.lm.head_memory.as_json(), "bits": 16, "precision": "float32", "group_size": None,
                    "health": server.served.lm.head_health.as_json()}
    assert head["health"]["status"] in ("checking", "ok")


def test_completion_equals_mlx_lm_and_dyno_generate(server, tiny_dir, tiny_lm, capsys):
    lm = tiny_lm()
    reference = plain_greedy(lm, lm.tokenizer.encode(CODE), 40)
    out = server.client.completions.create(model=MODEL_ID, prompt=CODE, max_tokens=40, temperature=0)
    assert out.choices[0].text == detokenize(lm, reference)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(lm.tokenizer.encode(CODE)), len(reference))
    assert out.choices[0].finish_reason == ("stop" if reference[-1] in lm.eos_token_ids else "length")
    assert cli.main(["generate", "--model", str(tiny_dir()), "--prompt", CODE, "--max-tokens", "40",
                     "--draft-depth", "3", "--json"]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert generated["tokens"] == reference and generated["text"] == out.choices[0].text


def test_chat_equals_mlx_lm_streamed_or_not(server, tiny_lm):
    lm = tiny_lm()
    prompt = chat_prompt(lm, CHAT)
    reference = plain_greedy(lm, prompt, 30)
    content, reasoning = split_think(detokenize(lm, reference))
    assert reasoning  # this random model happens to emit <think> itself: the split is exercised
    whole = server.client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=30, temperature=0)
    message = whole.choices[0].message
    assert (message.content, message.reasoning_content) == (content, reasoning)
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == len(reference)
    chunks = list(server.client.chat.completions.create(
        model=MODEL_ID, messages=CHAT, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text, finish, usage = stream_text(chunks)
    assert text == message.content and finish == whole.choices[0].finish_reason
    assert stream_text(chunks, "reasoning_content")[0] == message.reasoning_content
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []


def test_streamed_completion_equals_whole(server):
    kw = dict(model=MODEL_ID, prompt="import os\n", max_tokens=25, temperature=0.8, seed=11, top_p=0.9)
    whole = server.client.completions.create(**kw)
    streamed = list(server.client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert server.client.completions.create(**kw).choices[0].text == whole.choices[0].text  # seeded


@pytest.mark.parametrize("where", [slice(3, 5), slice(12, 14)], ids=["early", "in-held-back-bytes"])
def test_stop_string_cuts_the_text(server, tiny_lm, where):
    lm = tiny_lm()
    reference = plain_greedy(lm, lm.tokenizer.encode(CODE), 40)
    full = detokenize(lm, reference)
    stop = full[where]
    expected = full[: full.index(stop)]
    kw = dict(model=MODEL_ID, prompt=CODE, max_tokens=40, temperature=0, stop=[stop, "never appears"])
    out = server.client.completions.create(**kw)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
    if where.start == 3:  # generation ends at the token that completes the stop string
        assert detokenize(lm, reference[:5]) == full[:5] and out.usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in server.client.completions.create(stream=True, **kw)
                   if c.choices) == expected


def test_processors_keep_drafting_and_counters_move_exactly(server, tiny_lm):
    """A bias that decides every token: the head drafts it too, so each round keeps all 3 drafts."""
    (a,) = tiny_lm().tokenizer.encode("A")
    before_stats, before = server.stats(), server.metrics()
    out = server.client.completions.create(model=MODEL_ID, prompt=CODE, max_tokens=21, temperature=0,
                                           logit_bias={str(a): 100})
    assert out.choices[0].text == "A" * 21
    moved = {k: v - before.get(k, 0) for k, v in server.metrics().items()}
    assert moved["mlx:spec_decode_rounds_total"] == 5  # 1 prefill token + 5 rounds x (3 drafts + bonus)
    assert moved["mlx:draft_tokens_total"] == 15 and moved["mlx:draft_tokens_accepted_total"] == 15
    assert [moved[f"mlx:draft_tokens_accepted_per_position_total{{position={p}}}"] for p in (1, 2, 3)] == [5, 5, 5]
    assert moved["mlx:generation_tokens_total"] == 21
    assert moved["mlx:prompt_tokens_total"] == len(tiny_lm().tokenizer.encode(CODE))
    assert moved["mlx:requests_total{finish_reason=length}"] == 1
    assert moved["mlx:time_to_first_token_seconds_count"] == 1 and moved["mlx:e2e_request_latency_seconds_count"] == 1
    spec = server.stats()["speculative"]
    assert spec["mode"] == "mtp" and spec["draft_depth"] == 3
    assert spec["rounds"] - before_stats["speculative"]["rounds"] == 5
    assert [a - b for a, b in zip(spec["accepted_per_position"],
                                  before_stats["speculative"]["accepted_per_position"])] == [5, 5, 5]


def test_counters_match_the_engine_fold(server, tiny_lm):
    """Without forcing anything, /stats moves by what the engine drafts and accepts for the same request."""
    lm = tiny_lm()
    prompt = lm.tokenizer.encode("def parse(text):\n")
    expected = GenerationStats(draft_depth=3)
    for event in generate(lm, prompt, SamplingParams(max_tokens=30), SpecConfig("mtp", 3)):
        expected.add(event)
    before = server.stats()
    server.client.completions.create(model=MODEL_ID, prompt="def parse(text):\n", max_tokens=30, temperature=0)
    after = server.stats()
    for key in ("rounds", "draft_tokens", "accepted_tokens"):
        assert after["speculative"][key] - before["speculative"][key] == getattr(expected, key)
    assert after["tokens"]["generated"] - before["tokens"]["generated"] == len(expected.tokens)
    assert after["requests"]["total"] - before["requests"]["total"] == 1


def test_next_turn_reuses_the_cached_prefix(server, tiny_lm):
    lm = tiny_lm()
    first = server.client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=9, temperature=0)
    answer = first.choices[0].message.content
    turn2 = CHAT + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now a queue."}]
    prompt1, prompt2 = chat_prompt(lm, CHAT), chat_prompt(lm, turn2)
    reference1 = plain_greedy(lm, prompt1, 9)
    assert prompt2[: len(prompt1) + 9] == prompt1 + reference1  # the answer re-tokenizes to itself
    second = server.client.chat.completions.create(model=MODEL_ID, messages=turn2, max_tokens=20, temperature=0)
    # The first turn's last token was pending (never fed), so one less than prompt + answer is reused.
    assert second.usage.prompt_tokens_details.cached_tokens == len(prompt1) + 9 - 1
    assert second.choices[0].message.content == split_think(detokenize(lm, plain_greedy(lm, prompt2, 20)))[0]


@pytest.fixture(scope="module")
def thinking_server(tiny_dir, tmp_path_factory):
    folder = with_chat_template(tiny_dir(), tmp_path_factory.mktemp("thinking") / "tiny", THINKING_TEMPLATE)
    with running_server(folder) as running:
        yield running


def test_reasoning_is_split_and_template_kwargs_apply(thinking_server, tiny_lm):
    lm = tiny_lm()
    client = thinking_server.client
    # Default: the template opens <think>, so the answer so far is all reasoning.
    prompt = thinking_prompt(lm, CHAT, "<think>\n")
    content, reasoning = split_think(detokenize(lm, plain_greedy(lm, prompt, 24)), thinking=True)
    whole = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=24, temperature=0)
    assert whole.usage.prompt_tokens == len(prompt)
    assert (whole.choices[0].message.content, whole.choices[0].message.reasoning_content) == (content, reasoning)
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True))
    assert stream_text(chunks, "reasoning_content")[0] == whole.choices[0].message.reasoning_content
    # enable_thinking=False closes the block in the template: everything is content.
    closed = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=24, temperature=0,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    closed_prompt = thinking_prompt(lm, CHAT, "<think>\n\n</think>\n\n")
    assert closed.usage.prompt_tokens == len(closed_prompt)
    content, reasoning = split_think(detokenize(lm, plain_greedy(lm, closed_prompt, 24)))
    assert closed.choices[0].message.content == content
    assert getattr(closed.choices[0].message, "reasoning_content", None) == (reasoning or None)


def test_requests_without_sampling_fields_use_generation_config():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=-1, max_completion_tokens=9)
    params = sampling_params(req.sampling(), {"temperature": 0.6, "top_p": 0.95, "top_k": 20}, 64, room=100, vocab=320)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 0, 9)
    assert sampling_params(req.sampling(), {"do_sample": False, "temperature": 0.6}, 64, room=5,
                           vocab=320).temperature == 0
    assert sampling_params(req.sampling(), {}, 64, room=5, vocab=320).max_tokens == 5  # capped by the context left
