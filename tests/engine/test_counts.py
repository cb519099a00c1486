"""Counts add up: what the stats, the log line, /stats and /metrics say was accepted is what was
delivered, even when EOS, max_tokens, a stop string or a cancel cuts a round short."""

import random

import pytest

from helpers.serving import running_server
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.loader import load_checkpoint
from speculative.events import Round, Token
from speculative.stats import GenerationStats
from dyno_ui.paths import BUNDLED_MODEL
from dyno_ui.runtime.textstream import TextAssembler
from dyno_ui.playground.trace import Trace
from dyno_ui.runtime.worker import Job


def check_invariants(stats: GenerationStats):
    model = sum(1 for p in stats.provenance if p == "model")
    assert stats.provenance.count("draft") == stats.accepted_tokens == sum(stats.accepted_per_position)
    assert len(stats.tokens) == stats.accepted_tokens + model
    # A later position is accepted only in rounds that accepted the one before it.
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:]))


@pytest.fixture(scope="module")
def bundled():
    """The bundled dyno-tiny: its trained head accepts several drafts a round."""
    return load_checkpoint(BUNDLED_MODEL)


def test_a_round_cut_by_max_tokens_counts_only_delivered_drafts(bundled):
    lm = bundled
    prompt = lm.tokenizer.encode("def read_config(path):\n")
    # Cut one token into a round whose drafts were accepted: the cut round drafted 3, delivered 1.
    events = list(generate(lm, prompt, SamplingParams(max_tokens=40), SpecConfig("mtp", 3)))
    seen = 0
    for i, e in enumerate(events):
        seen += isinstance(e, Token)
        if isinstance(e, Round) and e.accepted >= 2:
            cut = seen + 1  # the first draft of this round is the last token delivered
            break
    else:
        raise AssertionError("the bundled head accepted two drafts in no round")
    stats = GenerationStats()
    for e in generate(lm, prompt, SamplingParams(max_tokens=cut), SpecConfig("mtp", 3)):
        stats.add(e)
    assert len(stats.tokens) == cut and stats.provenance[-1] == "draft"
    check_invariants(stats)
    assert stats.accepted_tokens < sum(e.accepted for e in events[: i + 1] if isinstance(e, Round))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_invariants_over_many_generations_with_random_cuts(bundled, temperature):
    lm = bundled
    rng = random.Random(7)
    prompts = ["def f(x):", "import os\n", "class A:\n    def", "for i in range(10):"]
    for n in range(12):
        prompt = lm.tokenizer.encode(rng.choice(prompts))
        params = SamplingParams(temperature=temperature, max_tokens=rng.randint(1, 30), seed=n)
        stats = GenerationStats()
        stop_after = rng.randint(1, 30)  # a consumer that stops early (stop string, cancel)
        events = generate(lm, prompt, params, SpecConfig("mtp", rng.randint(1, 4)))
        for e in events:
            stats.add(e)
            if isinstance(e, Token) and len(stats.tokens) >= stop_after:
                break
        events.close()
        check_invariants(stats)


def _traced_job(served, prompt_text, params, stops):
    """Submit one traced job straight to the worker; returns (Trace, Job) once it has finished."""
    import queue

    inbox = queue.Queue()
    lm = served.lm
    job = Job(lm.tokenizer.encode(prompt_text), params, TextAssembler(lm.tokenizer, stops), inbox.put,
              trace=True)
    trace = Trace(job.submitted_at)
    served.worker.submit(job)
    while not trace.finished:
        trace.add(inbox.get(timeout=60))
    return trace, job


def test_stats_and_metrics_move_by_the_sum_of_delivered_drafts():
    rng = random.Random(3)
    with running_server(BUNDLED_MODEL, SpecConfig("mtp", 3)) as server:  # own server: exact deltas
        before_stats, before_metrics = server.stats(), server.metrics()
        drafts = generated = 0
        per_position = [0, 0, 0]
        for n in range(10):
            stops = [rng.choice([" ", "(", ":", "\n", "e", "x"])] if n % 2 else []
            params = SamplingParams(temperature=0.0 if n % 3 else 0.7, max_tokens=rng.randint(1, 25), seed=n)
            trace, job = _traced_job(server.served, rng.choice(["def f(x):", "import os\n", "x = ["]),
                                     params, stops)
            delivered = job.stats.provenance
            assert len(delivered) == len(trace.token_ids)
            drafts += delivered.count("draft")
            generated += len(delivered)
            for i, c in enumerate(trace.accepted_per_position):
                per_position[i] += c
            check_invariants(job.stats)
            assert trace.accepted_per_position == job.stats.accepted_per_position
        after_stats, after_metrics = server.stats(), server.metrics()
    spec = after_stats["speculative"]
    assert spec["accepted_tokens"] - before_stats["speculative"]["accepted_tokens"] == drafts
    assert [a - b for a, b in zip(spec["accepted_per_position"],
                                  before_stats["speculative"]["accepted_per_position"])] == per_position
    assert after_stats["tokens"]["generated"] - before_stats["tokens"]["generated"] == generated
    moved = {k: after_metrics[k] - before_metrics.get(k, 0) for k in after_metrics}
    assert moved["mlx:draft_tokens_accepted_total"] == drafts
    assert moved["mlx:generation_tokens_total"] == generated
    assert [moved[f"mlx:draft_tokens_accepted_per_position_total{{position={p}}}"] for p in (1, 2, 3)] == per_position
    assert moved["mlx:draft_tokens_total"] == spec["draft_tokens"] - before_stats["speculative"]["draft_tokens"]
