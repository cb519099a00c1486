"""tools/round_work.py: per-thread CPU time, and rounds paired with their model calls leave the output plain."""

import os
import threading
import time

import pytest
from helpers.tools import load_tool

from speculative.config import SamplingParams
from tools.standin import shapes
from speculative.measure.bench import run_mlx_lm
from tools.standin.random_checkpoint import scaled_down, write_checkpoint
from tools.standin.scale import random_prompt

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread CPU time is read from Linux's /proc")


@pytest.fixture(scope="module")
def tool():
    return load_tool("round_work")


def test_a_busy_thread_is_a_worker_and_the_waiting_main_thread_is_not():
    from tools.standin.thread_time import since, stamp

    spun, leave = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        spun.set()
        leave.wait()  # alive while read: an ended thread leaves /proc/self/task, its time with it

    start = stamp()
    worker = threading.Thread(target=spin)
    worker.start()
    spun.wait()
    usage = since(start)
    leave.set()
    worker.join()
    assert usage.busiest_run >= 0.2 and usage.workers >= usage.busiest_run
    assert usage.main < 0.1 and usage.wall >= usage.busiest_run


def test_paired_rounds_keep_plain_greedy_output(tool, tmp_path):
    config = scaled_down(shapes.load("qwen3.5-0.8b")["text_config"])
    from speculative.loader import load_checkpoint

    lm = load_checkpoint(write_checkpoint(tmp_path, config, seed=1), mode="mtp")
    prompt = random_prompt(16)
    reference = run_mlx_lm(lm, prompt, SamplingParams(max_tokens=16)).tokens
    samples = tool.paired_rounds(lm, prompt, reference, 2, (0.9, 0.7), max_tokens=12)  # raises if the output moved
    assert samples and all(set(s) == {"round", "Tv", "Td"} for s in samples)
    assert all(s["round"].workers > 0 and s["Tv"].workers > 0 and s["Td"].workers > 0 for s in samples)
    figures = tool.summary(samples, 2)
    assert figures["rounds"] == len(samples) and figures["workers"]["ratio"] > 0
