"""Batched drafting over a real socket (`--decode-concurrency 4` with the MTP head, the bundled model):
every request, whatever runs beside it, gets exactly the answer the serial drafting server gives it
alone; rows of different lengths finish mid-round, a stop string, a cancel, a grammar beside free
rows, a reused prefix. Also: a seeded sampled answer is the same alone and in a batch, the memory
budget keeps rows out, and a full queue answers 503 with Retry-After in both APIs' envelopes."""

import logging
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from dyno_ui.paths import BUNDLED_MODEL
from dyno_ui.runtime.outputs import Failed, Finished, Traced
from dyno_ui.runtime.textstream import TextAssembler
from dyno_ui.runtime.worker import Job
from helpers.serving import MODEL_ID, running_server
from speculative.batched import BatchSpeculator
from speculative.config import SamplingParams, SpecConfig
from speculative.events import Round, Token
from speculative.round import depth_policy
from speculative.round.depth_policy import BatchCosts, DepthPolicy
from dyno_ui.server.run import describe

pytestmark = pytest.mark.e2e

SPEC = SpecConfig("mtp", 3)
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
FIRST = "# a first conversation\ndef first(x):\n"


@pytest.fixture(scope="module")
def serial():
    with running_server(BUNDLED_MODEL, SPEC) as running:
        yield running


@pytest.fixture(scope="module")
def batched():
    with running_server(BUNDLED_MODEL, SPEC, decode_concurrency=4, drafting_batch=True) as running:
        yield running


def completion(server, prompt, max_tokens, **kw):
    out = server.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    return out.choices[0].text, out.choices[0].finish_reason, out.usage.prompt_tokens_details.cached_tokens


def chat(server, content, max_tokens, **kw):
    out = server.client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}],
                                                max_tokens=max_tokens, temperature=0, **kw)
    m = out.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return m.content, getattr(m, "reasoning_content", None), calls, out.choices[0].finish_reason


def requests(stop: str, turn: str):
    """Name -> (function, args, kwargs): different prompt lengths and max_tokens, a stop string, a forced
    tool call and a json_schema answer beside free ones, a prompt that extends an earlier one."""
    return {
        "short": (completion, ("def f(x):", 40), {}),
        "long": (completion, ("# " + "a long comment line\n" * 20 + "def g(y):", 13), {}),
        "odd": (completion, ("class Point:\n", 29), {}),
        "stop": (completion, ("def f(x):", 40), {"stop": [stop]}),
        "logprobs": (completion, ("import os\n", 17), {"logprobs": 2}),
        "chat": (chat, ("Say something short.", 31), {"extra_body": NO_THINKING}),
        "tool": (chat, ("Add 2 and 3.", 60), {"tools": [ADD], "tool_choice": "required", "extra_body": NO_THINKING}),
        "json": (chat, ("Give n and ok.", 40), {"extra_body": NO_THINKING, "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}}),
        "turn": (completion, (turn, 21), {}),
    }


def answer(server, fn, args, kw):
    out = fn(server, *args, **kw)
    return out[:-1] if fn is completion else out  # cached tokens differ between servers


def test_every_request_in_a_batch_gets_its_answer_alone(serial, batched, caplog):
    first, _, _ = completion(batched, FIRST, 12)  # the batched server keeps its prompt's state
    turn = FIRST + first + "\n    return first\n"
    free = completion(serial, "def f(x):", 40)[0]
    stop = free[6:9]
    assert stop and free.find(stop) < 30
    todo = requests(stop, turn)
    want = {name: answer(serial, *r) for name, r in todo.items()}
    assert want["stop"][1] == "stop" and want["stop"][0] == free[: free.find(stop)]
    assert want["tool"][2] and want["tool"][2][0][0] == "add"

    def cancelled():
        """A stream its client leaves after a few chunks, while the others run."""
        stream = batched.client.completions.create(model=MODEL_ID, prompt="def h(z):", max_tokens=300,
                                                   temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()

    with caplog.at_level(logging.INFO, logger="dyno.serve"), ThreadPoolExecutor(len(todo) + 1) as pool:
        futures = {name: pool.submit(answer, batched, *r) for name, r in todo.items()}
        pool.submit(cancelled).result()
        got = {name: f.result() for name, f in futures.items()}
    assert got == want
    stats = batched.stats()
    assert stats["batch"]["max_width"] > 1 and stats["speculative"]["rounds"] > 0
    assert any(int(w) > 1 for w in stats["batch"]["rounds_by_width"])
    assert stats["batch"]["rounds_by_depth"] == {"3": sum(stats["batch"]["rounds_by_width"].values())}
    round_ms = stats["batch"]["round_ms"]  # every width that ran, timed at the one depth pinned
    assert set(round_ms) == set(stats["batch"]["rounds_by_width"]) and all(
        set(by_depth) == {"3"} and by_depth["3"] > 0 for by_depth in round_ms.values())
    assert stats["tokens"]["prompt_cached"] > 0  # the turn reused the first conversation's prompt
    assert stats["requests"]["failed"] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "dyno.serve"]
    assert any(re.search(r"drafts accepted, batch width \d+-\d+$", line) for line in lines), lines
    metrics = batched.metrics()
    assert metrics["mlx:batch_round_width_count"] > 0 and metrics["mlx:batch_rounds_by_depth_total{depth=3}"] > 0
    assert metrics["mlx:batch_round_seconds_count{depth=3}"] == metrics["mlx:batch_rounds_by_depth_total{depth=3}"]


def traced(server, spec: SpecConfig, max_tokens: int = 24) -> list:
    """The engine events of one playground-style request (trace on, its own speculation)."""
    out, lm = queue.Queue(), server.served.lm
    server.served.worker.submit(Job(lm.tokenizer.encode(FIRST), SamplingParams(max_tokens=max_tokens),
                                    TextAssembler(lm.tokenizer, []), out.put, spec=spec, trace=True, lm=lm))
    events = []
    while not isinstance(item := out.get(timeout=120), (Finished, Failed)):
        if isinstance(item, Traced):
            events.append(item.event)
    assert isinstance(item, Finished), item
    return events


def test_the_playgrounds_traced_requests_get_the_serial_engines_rounds_and_details(serial, batched):
    """What the playground shows, from a batch: tokens with provenance, each round's drafts and, with
    details on, each draft's p and acceptance chance, as the serial engine gives them; `off` pinned at
    depth 0 delivers the same text without rounds."""
    spec = SpecConfig("mtp", 2, details=True)
    alone, in_batch = traced(serial, spec), traced(batched, spec)
    tokens = lambda events: [(e.id, e.provenance) for e in events if isinstance(e, Token)]
    rounds = [e for e in in_batch if isinstance(e, Round)]
    assert tokens(in_batch) == tokens(alone)
    assert [(r.drafted, r.accepted, r.drafts) for r in rounds] == [
        (r.drafted, r.accepted, r.drafts) for r in alone if isinstance(r, Round)]
    assert rounds and all(r.details is not None and len(r.details.p) == r.drafted for r in rounds)
    for r, s in zip(rounds, (e for e in alone if isinstance(e, Round))):
        assert r.details.accept == s.details.accept and r.details.q == s.details.q == (None,) * r.drafted
        assert r.details.p == pytest.approx(s.details.p, abs=1e-5)
    plain = traced(batched, SpecConfig("off", 2))
    assert [e.id for e in plain if isinstance(e, Token)] == [t for t, _ in tokens(alone)]
    assert not any(isinstance(e, Round) for e in plain)
    assert not any(isinstance(e, Round) and e.details for e in traced(batched, SpecConfig("mtp", 2)))


def test_a_cancelled_row_is_counted_and_the_batch_goes_on(batched):
    before = batched.stats()["requests"]["cancelled"]
    stream = batched.client.completions.create(model=MODEL_ID, prompt="def h(z):", max_tokens=500, temperature=0,
                                               stream=True)
    next(iter(stream))
    stream.close()
    alone = completion(batched, "def f(x):", 20)
    for _ in range(200):
        if batched.stats()["requests"]["cancelled"] > before:
            break
        threading.Event().wait(0.05)
    assert batched.stats()["requests"]["cancelled"] == before + 1
    assert alone[1] == "length"


def test_a_seeded_sampled_request_is_the_same_alone_and_in_a_batch(batched):
    kw = dict(model=MODEL_ID, prompt="def sample(x):", max_tokens=30, temperature=0.9, seed=1234)
    alone = batched.client.completions.create(**kw).choices[0].text
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(completion, batched, f"# other {i}\n", 25 + i) for i in range(3)]
        beside = pool.submit(lambda: batched.client.completions.create(**kw).choices[0].text)
        assert beside.result() == alone
        [f.result() for f in others]


def answered_together(server, todo):
    """Each of `todo`'s calls (name -> a function of the server), made while the engine thread is
    held, so that their requests join the batch together: name -> its result."""
    worker, gate = server.served.worker, threading.Event()
    busy = worker.call(lambda: gate.wait(60))  # the engine thread holds here while the requests queue
    with ThreadPoolExecutor(len(todo)) as pool:
        futures = {name: pool.submit(fn, server) for name, fn in todo.items()}
        deadline = time.monotonic() + 60
        while worker.jobs.qsize() < len(todo) and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        got = {name: f.result() for name, f in futures.items()}
    assert busy.result() is True
    return got


def completing(prompt, max_tokens):
    """A completion request as a function of the server: (text, finish reason)."""
    return lambda server: completion(server, prompt, max_tokens)[:2]


def test_requests_that_wait_together_are_prefilled_together(batched, serial, monkeypatch):
    """Requests queued while the engine thread is busy join the batch in one prefill, prompts of
    different lengths padded together, and each gets the serial server's answer."""
    todo = {"short": ("def f(x):", 20), "long": ("# " + "a comment line\n" * 4 + "def g(y):", 15),
            "odd": ("class Point:\n", 25)}
    want = {name: completion(serial, *args)[:2] for name, args in todo.items()}
    sizes, join_all = [], BatchSpeculator.join_all

    def counted(self, joiners):
        sizes.append(len(joiners))
        return join_all(self, joiners)

    monkeypatch.setattr(BatchSpeculator, "join_all", counted)
    got = answered_together(batched, {name: completing(*args) for name, args in todo.items()})
    assert got == want and sizes == [len(todo)]


def test_requests_sharing_a_system_prompt_reuse_it_when_they_arrive_together(batched, serial):
    """Chats queued together with one long system prompt: the first prefills it, the others wait for
    its state in the prompt cache and resume there; every answer is the serial server's."""
    system = "You review code. " + "Answer briefly and name the line you mean. " * 10

    def chatting(question):
        def call(server):
            out = server.client.chat.completions.create(
                model=MODEL_ID, max_tokens=12, temperature=0, extra_body=NO_THINKING,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            return out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens
        return call

    todo = {name: chatting(question) for name, question in (("a", "Is x = 1 fine?"), ("b", "What does pass do?"))}
    want = {name: call(serial)[0] for name, call in todo.items()}
    got = answered_together(batched, todo)
    assert {name: text for name, (text, _) in got.items()} == want
    assert sorted(cached for _, cached in got.values())[-1] > 64  # the later one resumed after the system prompt


def test_a_prefill_that_fails_together_is_retried_row_by_row(batched, serial, monkeypatch):
    """If the joiners' shared prefill raises (memory, say), each joins alone: no request is lost."""
    todo = {"a": ("def f(x):", 12), "b": ("class Point:\n", 9)}
    want = {name: completion(serial, *args)[:2] for name, args in todo.items()}
    sizes, join_group = [], BatchSpeculator._join_group

    def fails_together(self, joiners):
        sizes.append(len(joiners))
        if len(joiners) > 1:
            raise MemoryError("out of memory")
        return join_group(self, joiners)

    monkeypatch.setattr(BatchSpeculator, "_join_group", fails_together)
    got = answered_together(batched, {name: completing(*args) for name, args in todo.items()})
    assert got == want and sizes == [2, 1, 1]


def test_a_failing_row_fails_alone(batched, serial):
    class BrokenText(TextAssembler):
        def __init__(self, tokenizer):
            super().__init__(tokenizer, [])
            self.seen = 0

        def add(self, token):
            self.seen += 1
            if self.seen == 3:
                raise RuntimeError("boom in one row")
            return super().add(token)

    lm = batched.served.lm
    want = completion(serial, "def f(x):", 20)
    out = queue.Queue()
    with ThreadPoolExecutor(3) as pool:
        good = [pool.submit(completion, batched, "def f(x):", 20) for _ in range(2)]
        batched.served.worker.submit(Job(lm.tokenizer.encode("def k(x):"), SamplingParams(max_tokens=30),
                                         BrokenText(lm.tokenizer), out.put, lm=lm))
        while not isinstance(final := out.get(timeout=120), (Finished, Failed)):
            pass
        answers = [f.result() for f in good]
    assert isinstance(final, Failed) and final.message == "generation failed: boom in one row"
    assert [a[:2] for a in answers] == [want[:2]] * 2


def test_rows_wait_for_memory_and_still_get_their_answers(serial):
    want = [completion(serial, f"def m{i}(x):", 10 + i)[:2] for i in range(3)]
    with running_server(BUNDLED_MODEL, SPEC, decode_concurrency=4, drafting_batch=True,
                        worker_kw={"max_batch_memory": 1}) as tight:
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda i: completion(tight, f"def m{i}(x):", 10 + i)[:2], range(3)))
        assert got == want
        assert tight.stats()["batch"]["max_width"] == 1  # a row alone always fits; two never do


def test_the_depth_policy_picks_each_rounds_depth_by_width(serial, monkeypatch):
    """Costs where a verify pass is free alone and dear beside others: alone a row drafts at 3, in
    company at 0 (plain batched rounds); every answer is still the one serial drafting gives."""
    monkeypatch.setattr(depth_policy, "EXPLORE_EVERY", 10**9)  # only the costs choose: no neighbour is timed
    flat, steep = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, {1: 1.0, 2: 10.0, 3: 10.0, 4: 10.0}
    costs = BatchCosts({1: flat, 2: steep, 4: steep}, {1: 0.01, 2: 0.01, 4: 0.01})
    spec = replace(SPEC, policy=DepthPolicy(costs, [0.9, 0.9, 0.9], max_depth=3))
    prompts = [(f"def p{i}(x):", 12 + 3 * i) for i in range(3)]
    want = [completion(serial, *p)[:2] for p in prompts]
    with running_server(BUNDLED_MODEL, spec, decode_concurrency=4, drafting_batch=True) as server:
        assert describe(server.served.worker) == (
            "batched MTP drafting of up to 4 requests, depth 0-3 chosen each round by measured cost")
        assert completion(server, *prompts[0])[:2] == want[0]
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: completion(server, *p)[:2], prompts))
        by_depth = server.stats()["batch"]["rounds_by_depth"]
        chosen = server.served.worker.policy.chosen
    assert got == want
    assert set(by_depth) == {"0", "3"}
    assert set(chosen[1]) == {3} and all(set(chosen[w]) == {0} for w in chosen if w > 1)


def test_a_round_that_a_pinned_row_deepens_is_timed_and_counted_at_the_depth_it_ran():
    recorded = []

    class Recording(DepthPolicy):
        def record(self, width, depth, seconds, then=None):
            recorded.append((width, depth, then))

    spec = replace(SPEC, policy=Recording(None, [], pinned=1))
    with running_server(BUNDLED_MODEL, spec, decode_concurrency=2, drafting_batch=True) as server:
        traced(server, SpecConfig("mtp", 3))  # the playground's request, pinned at 3
        by_depth = server.stats()["batch"]["rounds_by_depth"]
    assert set(by_depth) == {"3"}
    assert recorded and {(w, d, t) for w, d, t in recorded} == {(1, 3, 3)}


@pytest.mark.parametrize("drafting", [True, False], ids=["drafting-batch", "serial"])
def test_a_full_queue_answers_503_with_retry_after(drafting):
    kw = dict(decode_concurrency=2, drafting_batch=True) if drafting else {}
    with running_server(BUNDLED_MODEL, SPEC, worker_kw={"max_queue": 1}, **kw) as server:
        started, release = threading.Event(), threading.Event()
        # The engine thread waits here; until it has taken this call off the queue, the call itself
        # is the one queued item and a request would be refused.
        blocked = server.served.worker.call(lambda: (started.set(), release.wait(60)))
        assert started.wait(30)
        body = {"model": MODEL_ID, "prompt": "x", "max_tokens": 3}
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(server.post, "/v1/completions", json=body)
            for _ in range(200):  # until the first request waits in the queue
                if server.served.worker.jobs.qsize() == 1:
                    break
                threading.Event().wait(0.02)
            openai_reply = server.post("/v1/completions", json=body)
            anthropic_reply = server.post("/v1/messages", json={
                "model": MODEL_ID, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
            release.set()
            assert queued.result().status_code == 200
        blocked.result(timeout=10)
        assert server.post("/v1/completions", json=body).status_code == 200
    assert openai_reply.status_code == 503 and openai_reply.headers["retry-after"] == "1"
    assert openai_reply.headers["x-should-retry"] == anthropic_reply.headers["x-should-retry"] == "true"
    assert openai_reply.json()["error"]["code"] == "queue_full"
    assert openai_reply.json()["error"]["type"] == "server_error"
    assert anthropic_reply.status_code == 503 and anthropic_reply.headers["retry-after"] == "1"
    assert anthropic_reply.json()["type"] == "error"
    assert anthropic_reply.json()["error"]["type"] == "overloaded_error"
