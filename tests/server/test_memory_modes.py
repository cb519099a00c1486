"""Memory on the engine thread, in every mode (speculative/backend/memory.py through EngineWorker's seam): the
model wired while requests decode and released after, serial and batched, drafting and plain; a
replaced model's buffers cleared once nothing refers to it (the playground's Models tab); and the
one-line notice when a given budget and the model exceed the device's memory."""

import logging
import queue
import weakref

import pytest

from dyno_ui.runtime.outputs import Failed, Finished, Traced
from dyno_ui.runtime.served import ServedModel
from dyno_ui.runtime.textstream import TextAssembler
from dyno_ui.runtime.worker import EngineWorker, Job
from helpers.memory import WatchedMemory
from speculative.config import SamplingParams, SpecConfig
from speculative.events import Token
from speculative.loader import load_checkpoint
from speculative.backend.memory import budget_notice, device_memory, model_bytes

MODES = {  # decode concurrency, speculation: the four engine loops
    "serial-drafting": (1, SpecConfig("mtp", 2)),
    "serial-plain": (1, SpecConfig("off")),
    "batched-drafting": (2, SpecConfig("mtp", 2)),
    "batched-plain": (2, SpecConfig("off")),
}


@pytest.mark.parametrize("mode", MODES)
def test_the_engine_thread_wires_the_model_while_decoding(tiny_lm, mode):
    concurrency, spec = MODES[mode]
    watched = WatchedMemory()
    worker = EngineWorker(lambda: (tiny_lm(), spec), decode_concurrency=concurrency, memory=watched.memory)
    lm = worker.start()
    out = queue.Queue()
    held = {"event": [], "end": []}

    def sink(item):  # the engine's tokens, traced as they come (the plain batch traces none), then the end
        if isinstance(item, Traced) and isinstance(item.event, Token):
            held["event"].append(watched.wired)
        elif isinstance(item, (Finished, Failed)):
            held["end"].append(watched.wired)
        out.put(item)

    for seed in range(2):
        worker.submit(Job(lm.tokenizer.encode("def f(x):"), SamplingParams(max_tokens=12, seed=seed),
                          TextAssembler(lm.tokenizer, []), sink, trace=True))
    ends = _ends(out, 2)
    worker.close()
    assert all(isinstance(e, Finished) for e in ends), ends
    assert all(held["event"]) and (held["event"] or mode == "batched-plain")
    # Serial: each request's generation takes the limit and gives it back before it finishes;
    # batched: the batch holds it while it serves, as mlx-lm's BatchGenerator does.
    assert held["end"] == [concurrency > 1] * 2
    assert watched.count("wire") == watched.count("unwire") == (2 if concurrency == 1 else 1)
    assert not watched.wired and set(watched.threads) == {"dyno-engine"}


def _ends(out: queue.Queue, n: int):
    got = []
    while len(got) < n:
        item = out.get(timeout=60)
        if isinstance(item, (Finished, Failed)):
            got.append(item)
    return got


def test_a_replaced_model_is_let_go_and_its_buffers_cleared(tiny_dir, tiny_lm):
    """The playground's swap (Sessions.load's steps): once the served model and the worker have
    dropped the old one, MLX's buffer cache is cleared (mlx-lm's server does so before it loads another)."""
    watched = WatchedMemory()
    worker = EngineWorker(lambda: (load_checkpoint(tiny_dir("tied-gqa2")), SpecConfig("auto", 2)),
                          memory=watched.memory)
    served = ServedModel(id="old", lm=worker.start(), worker=worker, default_max_tokens=8, created=0)
    old = weakref.ref(served.lm)
    cleared_with_old_alive = []
    watched.on_clear = lambda: cleared_with_old_alive.append(old() is not None)
    try:
        served.replace(worker.replace_model(lambda: (tiny_lm("untied-mha"), SpecConfig("auto", 2))).result(60))
        worker.call(lambda: None).result(60)  # the work queued behind the swap has run
    finally:
        worker.close()
    assert served.lm is tiny_lm("untied-mha") and old() is None
    assert False in cleared_with_old_alive  # a clear came once nothing held the old model


def test_a_given_budget_that_does_not_fit_beside_the_model_is_noticed(tiny_lm, caplog):
    lm = tiny_lm()
    budget = device_memory()  # with the model's bytes, more than the device has
    with caplog.at_level(logging.WARNING, logger="dyno.serve"):
        worker = EngineWorker(lambda: (lm, SpecConfig("off")), prompt_cache_bytes=budget)
        worker.start()
        worker.close()
    expected = budget_notice(model_bytes(lm.model, lm.head), device_memory(), {"--prompt-cache-bytes": budget})
    assert expected.startswith("dyno: warning: --prompt-cache-bytes ")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("dyno: warning: --")] == [expected]
