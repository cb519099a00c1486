"""`mlx.launch -n 2 ... dyno serve --distributed pipeline`: rank 0 serves the API with drafting on
across both ranks, answers are one process's greedy text, /stats counts each round once, a stop
string halts every rank, and Ctrl-C ends the whole group."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dyno_ui.paths import BUNDLED_MODEL
from helpers.reference import plain_greedy
from helpers.run import LAUNCH, ROOT, free_ports, idle_stdin
from helpers.serving import detokenize
from speculative.loader import load_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def group():
    """Two local ranks on the ring backend, in a session of their own (so Ctrl-C reaches all of them)."""
    cmd = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "--starting-port",
           str(free_ports(2)), sys.executable, "-m", "dyno_ui", "serve", "--distributed", "pipeline", "--port", "0",
           "--draft-depth", "2"]
    with idle_stdin() as stdin:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        line = proc.stdout.readline()
        m = re.match(r"^dyno: serving dyno-tiny at (http://127\.0\.0\.1:\d+)/v1 \(MTP drafting, depth 2, pipeline "
                     r"across 2 ranks\)$", line)
        if not m:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(line + proc.stderr.read())
        yield proc, m.group(1)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_split_server_answers_greedy_and_halts_every_rank_on_a_stop(group):
    proc, url = group
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    lm = load_checkpoint(BUNDLED_MODEL, mode="off")
    want = detokenize(lm, plain_greedy(lm, lm.tokenizer.encode(PROMPT), 40))
    first = client.completions.create(model="dyno-tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert first.choices[0].text == want and first.choices[0].finish_reason == "length"
    stopped = client.completions.create(model="dyno-tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                        stop=["file"])
    assert stopped.choices[0].finish_reason == "stop" and want.startswith(stopped.choices[0].text + "file")
    # The follower stopped with rank 0: the next request's collectives still pair up.
    again = client.completions.create(model="dyno-tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert again.choices[0].text == want
    spec = httpx.get(url + "/stats").json()["speculative"]
    assert spec["mode"] == "mtp" and spec["draft_depth"] == 2
    assert spec["accepted_tokens"] == sum(spec["accepted_per_position"]) > 0


def test_ctrl_c_ends_every_rank(group):
    proc, _ = group
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground group
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the group still ran 60 s after Ctrl-C; its stderr:\n" + proc.communicate()[1][-6000:])
    assert time.monotonic() - start < 30
    dyno_frames = [line for line in err.splitlines() if "dyno_ui" in line or "speculative/" in line]
    assert dyno_frames == [], err  # mlx.launch may print its own KeyboardInterrupt; ours never a traceback
    # Every rank ends with 0: a rank ending otherwise makes mlx.launch terminate the others mid-shutdown.
    assert "exited with code" not in err and "was killed" not in err, err
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", "dyno_ui serve --distributed pipeline --port 0"], capture_output=True,
                          text=True)
    assert left.returncode == 1 and left.stdout == "", left.stdout  # 1: no such process left
