"""Multi-turn reuse through a real server and the official clients: thinking turns, stops, cancels,
regenerates, batches and restarts reuse what they share, report it truthfully (usage, /stats,
/metrics), and answer exactly what a cold run answers."""

import logging
import time
from contextlib import contextmanager

import httpx
import pytest

from dyno_ui import cli
from dyno_ui.cli.serve import options_from
from dyno_ui.paths import BUNDLED_MODEL
from dyno_ui.runtime.served import ServedModel
from dyno_ui.runtime.worker import EngineWorker
from dyno_ui.server.app import create_app
from helpers.cache_files import flip_array_bytes
from helpers.reference import plain_greedy, template_tokens
from helpers.serving import MODEL_ID, Running, detokenize, running_server, serving_in_thread, split_think
from helpers.tiny_models import with_chat_template
from speculative.batched import Leaving
from speculative.config import SpecConfig
from speculative.loader import load_checkpoint

pytestmark = pytest.mark.e2e

# Qwen3.5's shape: the generation prompt opens <think>; earlier answers come back without it.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
SYSTEM = {"role": "system", "content": "You write small, correct Python functions for a utility module."}
TOOL = {"type": "function", "function": {"name": "run_tests", "description": "Run one module's tests", "parameters": {
    "type": "object", "properties": {"module": {"type": "string", "enum": ["textwrap", "json"]}},
    "required": ["module"], "additionalProperties": False}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASKS = ["A function that reverses a list.", "Now one that sorts it.", "And one that sums it."]


@contextmanager
def server_with(model_dir, folder=None, decode_concurrency=1, memory=None):
    """A server whose prompt cache has `memory` bytes (None: the default) and the disk tier `folder`."""
    mode = "off" if decode_concurrency > 1 else "auto"
    worker = EngineWorker(lambda: (load_checkpoint(model_dir, mode=mode), SpecConfig(mode, 3)),
                          decode_concurrency=decode_concurrency, prompt_cache_bytes=memory, prompt_cache_dir=folder)
    lm = worker.start()
    served = ServedModel(id=MODEL_ID, lm=lm, worker=worker, default_max_tokens=64, created=0)
    with serving_in_thread(create_app(served)) as url:
        yield Running(url, served)


@pytest.fixture(scope="module")
def thinking_dir(tiny_dir, tmp_path_factory):
    return with_chat_template(tiny_dir(), tmp_path_factory.mktemp("thinking") / "tiny", THINKING_TEMPLATE)


def template(lm, messages):
    return lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def last_message_start(lm, prompt):
    (marker,) = lm.tokenizer.encode("<|im_start|>")
    return max(i for i, t in enumerate(prompt) if t == marker)


def test_thinking_turns_and_a_regenerate_reuse_up_to_the_answer_and_match_cold_runs(thinking_dir):
    with server_with(thinking_dir) as server:
        lm = server.served.lm
        messages, before = [SYSTEM], server.stats()
        reported = 0
        for i, ask in enumerate(ASKS + ASKS[-1:]):  # the last turn asked again: a regenerate
            if i < len(ASKS):
                messages = messages + [{"role": "user", "content": ask}]
            prompt = template(lm, messages)
            reference = plain_greedy(lm, prompt, 20)
            reply = server.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20,
                                                          temperature=0)
            content, reasoning = split_think(detokenize(lm, reference), thinking=True)
            assert (reply.choices[0].message.content or "", reply.choices[0].message.reasoning_content) == (
                content, reasoning)
            cached = reply.usage.prompt_tokens_details.cached_tokens
            reported += cached
            # The template dropped the last answer's <think> text: everything before its message is reused.
            previous = template(lm, messages[:-2]) if i else []
            assert cached == (0 if i == 0 else last_message_start(lm, previous) if i < len(ASKS)
                              else last_message_start(lm, prompt))
            if i < len(ASKS) - 1:
                messages = messages + [{"role": "assistant", "content": content}]
        after, metrics = server.stats(), server.metrics()
        assert after["tokens"]["prompt_cached"] - before["tokens"]["prompt_cached"] == reported
        assert metrics["mlx:prompt_tokens_cached_total"] == reported
        # Anthropic's usage says the same: the first turn asked again through the Messages API.
        reply = server.anthropic().messages.create(model=MODEL_ID, max_tokens=5, system=SYSTEM["content"],
                                                   messages=[{"role": "user", "content": ASKS[0]}])
        first = template(lm, [SYSTEM, {"role": "user", "content": ASKS[0]}])
        assert reply.usage.cache_read_input_tokens == last_message_start(lm, first)
        assert reply.usage.input_tokens == len(first) - last_message_start(lm, first)


def test_a_stop_string_and_a_client_leaving_keep_the_prefix(tiny_dir, tiny_lm):
    lm = tiny_lm()
    with running_server(tiny_dir(), SpecConfig("auto", 3)) as server:
        messages = [SYSTEM, {"role": "user", "content": ASKS[0]}]
        prompt = template(lm, messages)
        full = detokenize(lm, plain_greedy(lm, prompt, 30))
        stop = full[6:8]
        reply = server.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=30,
                                                      temperature=0, stop=[stop])
        assert reply.choices[0].finish_reason == "stop"
        follow = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": ASKS[1]}]
        again = server.client.chat.completions.create(model=MODEL_ID, messages=follow, max_tokens=12, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == last_message_start(lm, prompt)
        assert again.choices[0].message.content == split_think(detokenize(lm, plain_greedy(
            lm, template(lm, follow), 12)))[0]
        # A client that leaves mid-stream: the state it reached is kept, its prompt's end included.
        text = "class Queue:\n    def put(self, item):\n"
        cancel_a_stream(server, text)
        ids = lm.tokenizer.encode(text + "        pass\n")
        out = server.client.completions.create(model=MODEL_ID, prompt=text + "        pass\n", max_tokens=10,
                                               temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens >= len(lm.tokenizer.encode(text)) - 1
        assert out.choices[0].text == detokenize(lm, plain_greedy(lm, ids, 10))


def test_batched_turns_and_a_restart_reuse_and_match_cold_runs(tiny_dir, tiny_lm, tmp_path):
    """A drafting server keeps its turn on disk at shutdown; a batched server started on that folder
    continues the conversation from it, then keeps its own turns (a stop string included)."""
    lm = tiny_lm()
    messages = [SYSTEM, {"role": "user", "content": ASKS[0]}]
    with server_with(tiny_dir(), folder=tmp_path) as first:
        reply = first.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=9, temperature=0)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1
    answer = plain_greedy(lm, template(lm, messages), 9)
    first_prompt = template(lm, messages)
    with server_with(tiny_dir(), folder=tmp_path, decode_concurrency=2) as batched:
        # Turn 2 from the drafting server's file: its prompt and answer but the pending last token.
        messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                               {"role": "user", "content": ASKS[1]}]
        prompt = template(lm, messages)
        assert prompt[: len(first_prompt) + 8] == first_prompt + answer[:8]  # the answer re-renders as itself
        reference = detokenize(lm, plain_greedy(lm, prompt, 12))
        stop = reference[3:5]
        reply = batched.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12,
                                                       temperature=0, stop=[stop])
        assert reply.choices[0].message.content == split_think(reference[: reference.index(stop)])[0]
        assert reply.usage.prompt_tokens_details.cached_tokens == len(first_prompt) + 8
        # Turn 3 from the batched server's own entry, cut by that stop string: its checkpoint at the
        # start of the answer's message serves.
        messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                               {"role": "user", "content": ASKS[2]}]
        third = template(lm, messages)
        reply = batched.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12,
                                                       temperature=0)
        assert reply.choices[0].message.content == split_think(detokenize(lm, plain_greedy(lm, third, 12)))[0]
        assert reply.usage.prompt_tokens_details.cached_tokens == last_message_start(lm, prompt)


def test_a_damaged_file_on_disk_is_prefilled_cold_after_a_restart(tiny_dir, tiny_lm, tmp_path, caplog):
    """Bytes flipped in the arrays of the file a server left (its header intact): the next server
    answers the follow-up exactly as a cold run, prefilling all of it, and removes the file."""
    lm = tiny_lm()
    messages = [SYSTEM, {"role": "user", "content": ASKS[0]}]
    with server_with(tiny_dir(), folder=tmp_path) as first:
        reply = first.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=9, temperature=0)
    (path,) = tmp_path.rglob("*.safetensors")
    assert flip_array_bytes(path)
    messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                           {"role": "user", "content": ASKS[1]}]
    cold = detokenize(lm, plain_greedy(lm, template(lm, messages), 12))
    with caplog.at_level(logging.WARNING, logger="dyno.serve"), server_with(tiny_dir(), folder=tmp_path) as second:
        reply = second.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12,
                                                      temperature=0)
        assert reply.choices[0].message.content == split_think(cold)[0]
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        assert not path.exists()
    notices = [r.getMessage() for r in caplog.records if "prompt cache" in r.getMessage()]
    assert notices == [f"dyno: prompt cache: removed {path}: its arrays do not match their checksum "
                       "(the file was damaged)"]


def chat_turns(server, lm, turns):
    """A greedy conversation without thinking, one turn per (ask, max_tokens, stop string or None),
    each reply checked against plain greedy decoding of its prompt; the client keeps a reply's stop
    string in the history, so the next prompt extends all its row delivered. Returns each reply's
    (content, finish reason, cached tokens) and each prompt's length."""
    messages, out, lengths = [SYSTEM], [], []
    for ask, max_tokens, stop in turns:
        messages = messages + [{"role": "user", "content": ask}]
        prompt = template_tokens(lm, messages)
        text = detokenize(lm, plain_greedy(lm, prompt, max_tokens))
        reply = server.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stop=stop and [stop], extra_body=NO_THINKING)
        content = reply.choices[0].message.content
        assert content == split_think(text[: text.index(stop)] if stop else text)[0]
        out.append((content, reply.choices[0].finish_reason, reply.usage.prompt_tokens_details.cached_tokens))
        lengths.append(len(prompt))
        messages = messages + [{"role": "assistant", "content": content + (stop or "")}]
    return out, lengths


def test_batched_drafting_turns_reuse_their_answers_as_the_serial_engine(monkeypatch):
    """A batched drafting server keeps each row's final state, settled to the tokens its client received
    but the last: turn 2 resumes after turn 1's answer, which max_tokens cut inside a round, and turn 3
    after turn 2's, which a stop string cut inside a round, as the serial drafting server's turns do."""
    kept = []  # per row kept: (tokens it emitted, tokens its client received)
    settle = Leaving.settle
    monkeypatch.setattr(Leaving, "settle", lambda self, n: kept.append((len(self.row.generated), n)) or settle(self, n))
    spec = SpecConfig("mtp", 3)
    turns = [(ASKS[0], 11, None), (ASKS[1], 40, "Return"), (ASKS[2], 12, None)]
    with running_server(BUNDLED_MODEL, spec, decode_concurrency=2, drafting_batch=True) as batched:
        got, lengths = chat_turns(batched, batched.served.lm, turns)
    rows_kept = list(kept)  # the batched rows' (the serial engine's one row settles through Leaving too)
    with running_server(BUNDLED_MODEL, spec) as serial:
        want, _ = chat_turns(serial, serial.served.lm, turns)
    assert got == want
    assert [finish for _, finish, _ in got] == ["length", "stop", "length"]
    assert got[1][2] == lengths[0] + 11 - 1  # the first prompt and answer, its last token pending
    assert got[2][2] == lengths[1] + rows_kept[1][1] - 1  # the same after the stop string
    assert len(rows_kept) == 3 and all(emitted > received for emitted, received in rows_kept[:2])  # cut inside rounds


def cancel_a_stream(server, text: str) -> None:
    """Stream a long completion of `text`, leave after a few chunks, wait for the cancel to be counted."""
    before = server.stats()
    body = {"model": MODEL_ID, "prompt": text, "max_tokens": 3000, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
            if i == 3:
                break
    deadline = time.monotonic() + 30
    while server.stats()["requests"]["cancelled"] == before["requests"]["cancelled"]:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)


def test_a_cancelled_batch_row_keeps_its_prefix(tiny_dir, tiny_lm):
    lm = tiny_lm()
    text = "def read_lines(path):\n"
    with running_server(tiny_dir(), decode_concurrency=2) as server:
        cancel_a_stream(server, text)
        ids = lm.tokenizer.encode(text + "    with")
        out = server.client.completions.create(model=MODEL_ID, prompt=text + "    with", max_tokens=10, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens >= len(lm.tokenizer.encode(text)) - 1
    assert out.choices[0].text == detokenize(lm, plain_greedy(lm, ids, 10))


def test_tool_turns_and_seeded_sampling_match_a_server_without_the_cache():
    """The bundled model: a forced call, its result, an answer, a sampled turn; the same answers
    as a server that prefills everything."""
    with server_with(BUNDLED_MODEL) as warm, server_with(BUNDLED_MODEL, memory=0) as cold:
        lm = warm.served.lm
        messages, asked = [SYSTEM, {"role": "user", "content": "Run the tests of textwrap."}], None
        turns = [dict(tool_choice="required"), dict(tool_choice="auto"), dict(temperature=0.8, seed=3)]
        for kw in turns:
            kw = {"temperature": 0, "max_tokens": 48, "tools": [TOOL], "extra_body": NO_THINKING, **kw}
            replies = [s.client.chat.completions.create(model=warm.served.id, messages=messages, **kw)
                       for s in (warm, cold)]
            a, b = (r.choices[0].message for r in replies)
            assert a.content == b.content
            assert getattr(a, "reasoning_content", None) == getattr(b, "reasoning_content", None)
            assert [(c.function.name, c.function.arguments) for c in a.tool_calls or []] == [
                (c.function.name, c.function.arguments) for c in b.tool_calls or []]
            cached = replies[0].usage.prompt_tokens_details.cached_tokens
            assert replies[1].usage.prompt_tokens_details.cached_tokens == 0
            if asked is None:
                assert a.tool_calls and cached == 0
            else:  # at least everything before the previous answer's message
                previous = lm.tokenizer.apply_chat_template(asked, tools=[TOOL], add_generation_prompt=True,
                                                            tokenize=True, enable_thinking=False)
                assert cached >= last_message_start(lm, previous) > 0
            asked = messages
            if a.tool_calls:
                call = a.tool_calls[0]
                messages = messages + [
                    {"role": "assistant", "content": a.content or "", "tool_calls": [
                        {"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "12 passed"}]
            else:
                messages = messages + [{"role": "assistant", "content": a.content or ""},
                                       {"role": "user", "content": "And json?"}]


def test_the_flags_become_options(capsys, tmp_path):
    args = cli.build_parser().parse_args(["serve", "--prompt-cache-bytes", "2GiB", "--prompt-cache-dir", str(tmp_path),
                                          "--prompt-cache-disk-bytes", "10GB"])
    options = options_from(args)
    assert (options.prompt_cache_bytes, options.prompt_cache_disk_bytes) == (2 * 2**30, 10**10)
    assert str(options.prompt_cache_dir) == str(tmp_path)
    assert cli.main(["serve", "--prompt-cache-bytes", "lots"]) == 2
    assert capsys.readouterr().err.strip() == ("dyno: error: --prompt-cache-bytes must be a number of bytes such as "
                                               "8GB, 512MiB or 0, got 'lots'")
