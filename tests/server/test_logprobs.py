"""Log-probabilities through the official openai client over a real socket: chat (`logprobs`,
`top_logprobs`) and completions (`logprobs`), streamed and not, with drafting on; the values are
plain mlx-lm's (generate_step) for the same tokens, and batched decoding (no drafts) gives the same."""

import math

import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import generate_step

from dyno_ui.paths import BUNDLED_MODEL
from helpers.serving import MODEL_ID, running_server
from speculative.config import SpecConfig

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = 0  # temperature (dyno-tiny's generation_config samples)
PROMPT = "def quicksort(xs):\n"
N = 24
# Verify rows are computed in one batch of k + 1 positions, plain decoding one at a time: the same
# float32 math in another reduction order agrees to rounding, not bit for bit.
TOL = 1e-4


@pytest.fixture(scope="module")
def server():
    with running_server(BUNDLED_MODEL, SpecConfig("mtp", 3)) as running:
        yield running


def plain(lm, prompt, n):
    """(token, float32 log-probabilities row) of mlx-lm's greedy generate_step, EOS included."""
    out = []
    for t, lp in generate_step(mx.array(prompt), lm.model, max_tokens=n):
        out.append((int(t), lp.astype(mx.float32)))
        if out[-1][0] in lm.eos_token_ids:
            break
    return out


def chat_prompt(lm):
    return lm.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, enable_thinking=False)


def check_against_plain(lm, entries, reference, top):
    """entries: (token text, bytes, logprob, [(text, logprob)]) per delivered token, vs mlx-lm."""
    tokens = [t for t, _ in reference if t not in lm.eos_token_ids]
    assert len(entries) == len(tokens)
    for (text, raw, logprob, alternatives), token, (_, row) in zip(entries, tokens, reference):
        assert abs(logprob - row[token].item()) < TOL
        assert len(alternatives) == top
        values = [v for _, v in alternatives]
        assert values == sorted(values, reverse=True) and abs(max(values) - logprob) < 1e-6  # greedy: the top one
        assert max(abs(a - b) for a, b in zip(values, mx.sort(row)[::-1][:top].tolist())) < TOL
        assert bytes(raw).decode("utf-8", "replace") == text


def chat_entries(content):
    return [(e.token, e.bytes, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in content]


def test_chat_logprobs(server):
    lm = server.served.lm
    out = server.client.chat.completions.create(
        model=MODEL_ID, temperature=GREEDY, messages=ASK, max_tokens=N, logprobs=True, top_logprobs=5,
        extra_body=NO_THINKING)
    choice = out.choices[0]
    content = choice.logprobs.content
    check_against_plain(lm, chat_entries(content), plain(lm, chat_prompt(lm), N), 5)
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    assert all(-math.inf < e.logprob <= 0 for e in content)


def test_chat_logprobs_streamed_equal_the_whole_answer(server):
    args = dict(model=MODEL_ID, temperature=GREEDY, messages=ASK, max_tokens=N, logprobs=True, top_logprobs=2,
                extra_body=NO_THINKING)
    whole = server.client.chat.completions.create(**args).choices[0].logprobs.content
    streamed = []
    for chunk in server.client.chat.completions.create(stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, whole))
    assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_chat_without_logprobs_has_none(server):
    out = server.client.chat.completions.create(
        model=MODEL_ID, temperature=GREEDY, messages=ASK, max_tokens=4, extra_body=NO_THINKING)
    assert out.choices[0].logprobs is None
    out = server.client.chat.completions.create(
        model=MODEL_ID, temperature=GREEDY, messages=ASK, max_tokens=4, logprobs=True, extra_body=NO_THINKING)
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens
    assert all(e.top_logprobs == [] for e in out.choices[0].logprobs.content)


def completion_entries(lp):
    return [(t, list(t.encode()), v, sorted(top.items(), key=lambda kv: -kv[1]))
            for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]


def test_completion_logprobs(server):
    lm = server.served.lm
    out = server.client.completions.create(
        model=MODEL_ID, temperature=GREEDY, prompt=PROMPT, max_tokens=N, logprobs=3)
    choice = out.choices[0]
    lp = choice.logprobs
    check_against_plain(lm, completion_entries(lp), plain(lm, lm.tokenizer.encode(PROMPT), N), 3)
    # dyno-tiny's Python text is ASCII, so tokens are whole characters; mlx-lm's detokenizer drops
    # one space at the very start of the text, which the first token's own string keeps.
    assert "".join(lp.tokens) in (choice.text, " " + choice.text)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]

    streamed = []
    for chunk in server.client.completions.create(
        model=MODEL_ID, temperature=GREEDY, prompt=PROMPT, max_tokens=N, logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            c = chunk.choices[0].logprobs
            streamed += list(zip(c.tokens, c.token_logprobs, c.text_offset))
    assert [(t, o) for t, _, o in streamed] == list(zip(lp.tokens, lp.text_offset))
    assert all(abs(a - b) < TOL for (_, a, _), b in zip(streamed, lp.token_logprobs))


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
])
def test_out_of_range_is_a_400(server, route, body, param):
    r = server.post(route, json={"max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_top_logprobs_21_through_the_client(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(
            model=MODEL_ID, temperature=GREEDY, messages=ASK, max_tokens=2, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"


def test_batched_decoding_gives_the_same_logprobs(server):
    args = dict(model=MODEL_ID, temperature=GREEDY, prompt=PROMPT, max_tokens=N, logprobs=4)
    drafted = server.client.completions.create(**args).choices[0].logprobs
    with running_server(BUNDLED_MODEL, decode_concurrency=2) as batched:
        plain_lp = batched.client.completions.create(**args).choices[0].logprobs
    assert plain_lp.tokens == drafted.tokens
    assert all(abs(a - b) < TOL for a, b in zip(plain_lp.token_logprobs, drafted.token_logprobs))
    assert [list(d) for d in plain_lp.top_logprobs] == [list(d) for d in drafted.top_logprobs]
