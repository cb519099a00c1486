"""One request never hurts another: whatever fails inside one request fails it alone, with an
OpenAI-shaped error; the engine thread, the other requests, the prefix cache and the counters live on.
Shutdown answers every request. Seeds of any size and top_k above the vocabulary work everywhere."""

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from helpers.reference import plain_greedy
from dyno_ui.runtime.textstream import TextAssembler
from dyno_ui.runtime.outputs import Failed, Finished
from dyno_ui.runtime.plain_batch import greedy_row, guarded
from dyno_ui.runtime.worker import Job
from helpers.serving import MODEL_ID, detokenize, running_server
from speculative.measure.bench import run_mlx_lm
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.stats import GenerationStats

pytestmark = pytest.mark.e2e

PROMPT = "def add(a, b):"


class BrokenText(TextAssembler):
    """A request whose output handling raises at its `at`-th token (a stand-in for any per-request fault)."""

    def __init__(self, tokenizer, at: int):
        super().__init__(tokenizer, [])
        self.at, self.seen = at, 0

    def add(self, token):
        self.seen += 1
        if self.seen == self.at:
            raise RuntimeError("boom in one request")
        return super().add(token)


def submit(served, text_or_ids, params, text=None):
    """A job straight to the worker; returns its output queue."""
    lm = served.lm
    ids = lm.tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    out = queue.Queue()
    served.worker.submit(Job(ids, params, text or TextAssembler(lm.tokenizer, []), out.put, lm=lm))
    return out


def last(out: queue.Queue, timeout=120):
    """The job's final output (Finished or Failed), waiting at most `timeout` seconds for each item."""
    while True:
        item = out.get(timeout=timeout)
        if isinstance(item, (Finished, Failed)):
            return item


def completion(server, prompt=PROMPT, **kw):
    return server.client.completions.create(model=MODEL_ID, prompt=prompt, **{"max_tokens": 12, **kw})


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_failing_request_fails_alone(tiny_dir, tiny_lm, concurrency):
    lm = tiny_lm()
    want = detokenize(lm, plain_greedy(lm, lm.tokenizer.encode(PROMPT), 12))
    with running_server(tiny_dir(), SpecConfig("auto", 3), decode_concurrency=concurrency) as server:
        served = server.served
        with ThreadPoolExecutor(4) as pool:
            good = [pool.submit(completion, server) for _ in range(2)]
            bad = submit(served, PROMPT, SamplingParams(max_tokens=12),
                          BrokenText(served.lm.tokenizer, at=3))
            good += [pool.submit(completion, server) for _ in range(2)]
            failed = last(bad)
            answers = [f.result().choices[0].text for f in good]
        assert isinstance(failed, Failed) and failed.status == 500
        assert failed.message == "generation failed: boom in one request"
        assert answers == [want] * 4
        assert server.get("/health").status_code == 200
        assert server.stats()["requests"]["failed"] == 1


def test_a_failing_request_leaves_other_conversations_cached(tiny_dir, tiny_lm):
    lm = tiny_lm()
    with running_server(tiny_dir(), SpecConfig("auto", 3)) as server:
        first = lm.tokenizer.encode("x = 1\n")
        completion(server, first)
        completion(server, "import os\n")
        assert isinstance(last(submit(server.served, PROMPT, SamplingParams(max_tokens=12),
                                      BrokenText(lm.tokenizer, at=3))), Failed)
        turn = first + plain_greedy(lm, first, 12)[:12] + lm.tokenizer.encode("\ny")
        again = completion(server, turn)
    assert again.usage.prompt_tokens_details.cached_tokens == len(first) + 11


def test_a_sampler_that_raises_inside_a_batch_fails_only_its_row(tiny_lm):
    lm = tiny_lm("tied-gqa2", mode="off")
    bad_job = Job([], SamplingParams(), None, lambda _: None)
    # mlx-lm's own top-k with k past the vocabulary raises when the step is built.
    bad = guarded(make_sampler(1.0, top_k=lm.vocab_size + 5), bad_job, greedy_row)
    good_prompt = lm.tokenizer.encode(PROMPT)
    batch = BatchGenerator(lm.model, stop_tokens=[[t] for t in lm.eos_token_ids])
    good_uid, bad_uid = batch.insert([good_prompt, lm.tokenizer.encode("x")], max_tokens=[10, 10],
                                     samplers=[make_sampler(0.0), bad])
    tokens = []
    while True:
        responses = batch.next_generated()
        if bad_job.error is not None and bad_uid is not None:
            batch.remove([bad_uid])
            bad_uid = None
        for r in responses:
            if r.uid == good_uid:
                tokens.append(r.token)
        if not responses and bad_uid is None or len(tokens) == 10:
            break
    assert isinstance(bad_job.error, ValueError)
    assert tokens == plain_greedy(lm, good_prompt, 10)


def test_shutdown_answers_every_queued_and_in_flight_request(tiny_dir):
    with running_server(tiny_dir(), SpecConfig("auto", 3)) as server:
        served = server.served
        outs = [submit(served, PROMPT, SamplingParams(max_tokens=2000)) for _ in range(4)]
        served.worker.close(timeout=30)
        finals = [last(o, timeout=30) for o in outs]
        late = last(submit(served, PROMPT, SamplingParams(max_tokens=4)), timeout=5)
    assert isinstance(finals[0], (Finished, Failed))
    assert all(isinstance(f, Failed) and f.status == 503 for f in finals[1:])
    assert isinstance(late, Failed) and late.message == "the server is shutting down"


def test_batched_shutdown_answers_the_requests_in_flight(tiny_dir):
    with running_server(tiny_dir(), decode_concurrency=2) as server:
        served = server.served
        outs = [submit(served, PROMPT, SamplingParams(max_tokens=2000)) for _ in range(3)]
        served.worker.close(timeout=30)
        finals = [last(o, timeout=30) for o in outs]
    assert all(isinstance(f, (Finished, Failed)) for f in finals)


@pytest.mark.parametrize("seed", [2**64, 2**64 + 5, 2**200, -1, -(2**70)])
def test_any_integer_seed_works_and_reduces_modulo_2_64(seed):
    assert SamplingParams(temperature=1.0, seed=seed).seed == seed % 2**64


@pytest.mark.parametrize("concurrency", [1, 3])
def test_huge_and_negative_seeds_over_http(tiny_dir, concurrency):
    with running_server(tiny_dir(), SpecConfig("auto", 2), decode_concurrency=concurrency) as server:
        texts = {}
        for seed in (5, 2**64 + 5, 2**100, -3):
            texts[seed] = completion(server, temperature=1.0, seed=seed).choices[0].text
        assert server.get("/health").status_code == 200
        if concurrency == 1:  # equal reduced seeds draw alike (batched mode shares one RNG)
            assert texts[5] == texts[2**64 + 5]
            assert texts[-3] == completion(server, temperature=1.0, seed=2**64 - 3).choices[0].text


def test_top_k_at_or_above_the_vocabulary_means_no_top_k_on_every_path(tiny_dir, tiny_lm):
    lm = tiny_lm("tied-gqa2", mode="off")
    vocab, prompt = lm.vocab_size, lm.tokenizer.encode(PROMPT)

    def plain(top_k):
        stats = GenerationStats()
        for e in generate(lm, prompt, SamplingParams(temperature=1.0, top_k=top_k, seed=9, max_tokens=10),
                          SpecConfig("off")):
            stats.add(e)
        return stats.tokens

    assert plain(vocab) == plain(vocab + 1000) == plain(0)
    bench = [run_mlx_lm(lm, prompt, SamplingParams(temperature=1.0, top_k=k, seed=9, max_tokens=10)).tokens
             for k in (0, vocab, 10**9)]
    assert bench[0] == bench[1] == bench[2]
    for concurrency in (1, 3):  # one request at a time, so a seed fixes the draws in batched mode too
        with running_server(tiny_dir(), SpecConfig("off"), decode_concurrency=concurrency) as server:
            texts = [completion(server, temperature=1.0, seed=9, extra_body={"top_k": k}).choices[0].text
                     for k in (vocab, 10**9, 0)]
            assert texts[0] == texts[1] == texts[2]


def test_developer_role_is_system_and_reasoning_is_replayed(tiny_dir, tiny_lm):
    lm = tiny_lm()
    tok = lm.tokenizer
    with running_server(tiny_dir(), SpecConfig("auto", 2)) as server:
        served = server.served
        captured = []
        original = served.worker.submit

        def spy(job):
            captured.append(job.prompt)
            return original(job)

        served.worker.submit = spy
        history = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
                   {"role": "user", "content": "more"}]
        server.client.chat.completions.create(model=MODEL_ID, messages=history, max_tokens=2)
    want = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
         {"role": "user", "content": "more"}], add_generation_prompt=True, tokenize=True)
    assert captured == [list(want)]


@pytest.mark.parametrize("kwargs", [{"tokenize": False}, {"return_dict": True}, {"add_generation_prompt": False},
                                    {"chat_template": "{{ 'x' }}"}])
def test_template_kwargs_that_change_the_result_are_refused(tiny_dir, kwargs):
    with running_server(tiny_dir(), SpecConfig("auto", 2)) as server:
        r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "chat_template_kwargs": kwargs, "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"chat_template_kwargs: {next(iter(kwargs))!r} is set by the server"


@pytest.mark.parametrize("batched", [False, True], ids=["serial", "batched drafting"])
def test_a_model_load_while_requests_arrive_serves_each_with_one_model(tiny_dir, tiny_lm, batched):
    """The playground's Models tab swaps the model while two clients keep asking: every answer is one
    model's, whole; a batch finishes its rows before the swap and then serves the new model."""
    from dyno_ui.playground.sessions import Sessions

    old, new = tiny_lm("tied-gqa2"), tiny_lm("untied-mha")
    ids = old.tokenizer.encode(PROMPT)  # both tiny models share the byte tokenizer
    old_answer, new_answer = (detokenize(lm, plain_greedy(lm, ids, 8)) for lm in (old, new))
    assert old_answer != new_answer
    kw = dict(decode_concurrency=2, drafting_batch=True) if batched else {}
    with running_server(tiny_dir("tied-gqa2"), SpecConfig("auto", 7), **kw) as server:  # auto never picks 7
        stop = threading.Event()
        replies = []

        def client():
            while not stop.is_set():
                r = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
                replies.append((r.status_code, r.json()))

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        loaded = Sessions(server.served).load(str(tiny_dir("untied-mha")), notify=lambda m: None).result(120)
        stop.set()
        for t in threads:
            t.join(60)
        after = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        depth = server.served.worker.spec.draft_depth
        stats, metrics = server.stats(), server.metrics()
    assert replies and server.served.lm is loaded
    by_id = {MODEL_ID: old_answer, loaded.path.name: new_answer}
    for status, body in replies:
        if status == 200:  # answered by the model the response names
            assert body["choices"][0]["text"] == by_id[body["model"]]
        else:
            assert status == 503 and body["error"]["code"] in ("model_loading", None), body
    assert after.status_code == 200
    assert after.json()["choices"][0]["text"] == new_answer
    assert after.json()["model"] == loaded.path.name
    assert depth != 7 and stats["speculative"]["draft_depth"] == depth
    assert f"mlx:draft_tokens_accepted_per_position_total{{position={depth}}}" in metrics


def test_a_job_checked_against_a_replaced_model_is_refused(tiny_dir, tiny_lm):
    with running_server(tiny_dir("tied-gqa2"), SpecConfig("auto", 2)) as server:
        worker = server.served.worker
        stale = server.served.lm
        worker.replace_model(lambda: (tiny_lm("untied-mha"), SpecConfig("auto", 2))).result(60)
        out = queue.Queue()
        worker.submit(Job(stale.tokenizer.encode(PROMPT), SamplingParams(max_tokens=4),
                          TextAssembler(stale.tokenizer, []), out.put, lm=stale))
        final = last(out)
        assert server.get("/health").status_code == 200
    assert isinstance(final, Failed) and final.status == 503
    assert final.message == "the model was replaced while this request waited; send it again"


def test_a_batched_request_whose_sampler_raises_fails_alone(tiny_dir, tiny_lm, monkeypatch):
    import dyno_ui.runtime.plain_batch as batch_module
    from speculative.round.sampling import plain_sampler

    def sampler_for(params, vocab):  # the request with top-k 13 gets mlx-lm's top-k past the vocabulary
        if params.top_k == 13:
            return make_sampler(1.0, top_k=vocab + 5)
        return plain_sampler(params, vocab)

    monkeypatch.setattr(batch_module, "plain_sampler", sampler_for)
    lm = tiny_lm()
    want = detokenize(lm, plain_greedy(lm, lm.tokenizer.encode(PROMPT), 12))
    with running_server(tiny_dir(), decode_concurrency=3) as server:
        with ThreadPoolExecutor(3) as pool:
            good = [pool.submit(completion, server) for _ in range(2)]
            bad = pool.submit(server.post, "/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_k": 13})
            answers = [f.result().choices[0].text for f in good]
            reply = bad.result()
        assert server.get("/health").status_code == 200
        after = completion(server).choices[0].text
    assert answers == [want, want] and after == want
    assert reply.status_code == 500 and reply.json()["error"]["message"].startswith("generation failed: ")
