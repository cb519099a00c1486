"""Soak: `dyno serve` killed (SIGKILL) while it writes prompt-cache files under concurrent multi-turn
clients, then started again on the same folder: every answer, before and after each kill, equals a
cold run (plain mlx-lm greedy decoding of the whole conversation), and no file is ever found damaged."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from dyno_ui.paths import BUNDLED_MODEL
from helpers.reference import plain_greedy, template_tokens
from helpers.run import ROOT
from helpers.serving import detokenize, split_think
from speculative.loader import load_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLIENTS = 4
KILLS = 2  # servers killed; one more is started after the last kill
TURNS_AFTER = 2  # each client's turns on the last server
MAX_TOKENS = 16
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# A long shared system prompt: bigger files, longer writes for a kill to land in.
SYSTEM = ("You maintain a small Python utility module. Answer with short, correct functions and one line "
          "of explanation. " * 12)
ASKS = ["A function that reverses a list.", "Now one that sorts it.", "And one that sums it.",
        "One that counts the even numbers.", "One that joins words with commas.", "One that finds the maximum."]


class Server:
    """`dyno serve` on a free port with the prompt cache's disk tier in `folder` and no memory tier
    (every state kept goes to disk at once); its stderr in a file."""

    def __init__(self, folder, log):
        self.log = open(log, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dyno_ui", "serve", "--model", str(BUNDLED_MODEL), "--port", "0", "--no-ui",
             "--prompt-cache-dir", str(folder), "--prompt-cache-bytes", "0"],
            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=self.log)
        deadline, seen = time.monotonic() + 120, []
        while (line := self.proc.stdout.readline()) and not (m := re.match(r"^dyno: serving (\S+) at (\S+) ", line)):
            seen.append(line)
            assert time.monotonic() < deadline, seen
        assert line, seen
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # drain
        self.model, self.url = m.group(1), m.group(2)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()


class Client(threading.Thread):
    """One conversation: a turn after another until `turns` are done or the server goes away; each
    answered turn kept as (the messages asked, the answer's content, the prompt tokens reused)."""

    def __init__(self, index, server, messages, turns, done):
        super().__init__(daemon=True)
        self.index, self.messages, self.turns, self.done = index, messages, turns, done
        self.client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        self.model = server.model

    def run(self):
        for _ in range(self.turns):
            asked = self.messages + [{"role": "user", "content": ASKS[(self.index + len(self.messages)) % len(ASKS)]}]
            try:
                reply = self.client.chat.completions.create(model=self.model, messages=asked, max_tokens=MAX_TOKENS,
                                                            temperature=0, extra_body=NO_THINKING)
            except openai.APIConnectionError:
                return  # killed: the conversation goes on from its last answer on the next server
            content = reply.choices[0].message.content
            self.done.append((asked, content, reply.usage.prompt_tokens_details.cached_tokens))
            self.messages = asked + [{"role": "assistant", "content": content}]


def names(folder):
    return {p.name for d in folder.iterdir() if d.is_dir() for p in d.iterdir()}


def kill_while_writing(folder, server, clients, timeout=60):
    """SIGKILL `server` as soon as a new name shows up in the cache folder (a write begun: its
    temporary file, or a file written in place if writes were not atomic), or at `timeout`; True
    when one was seen."""
    deadline, seen, before = time.monotonic() + timeout, False, names(folder)
    while time.monotonic() < deadline and any(c.is_alive() for c in clients):
        if names(folder) - before:
            seen = True
            break
        time.sleep(0.0005)
    server.kill()
    return seen


def test_killed_while_writing_then_restarted_every_answer_equals_a_cold_run(tmp_path):
    folder, log = tmp_path / "cache", tmp_path / "serve.log"
    conversations = [[{"role": "system", "content": SYSTEM}] for _ in range(CLIENTS)]
    answered, caught, lives = [], [], []  # lives: answers so far at each server's end
    for life in range(KILLS + 1):
        server = Server(folder, log)
        last = life == KILLS
        clients = [Client(i, server, conversations[i], TURNS_AFTER if last else 50, answered)
                   for i in range(CLIENTS)]
        for c in clients:
            c.start()
        if last:
            for c in clients:
                c.join(120)
            server.proc.send_signal(signal.SIGINT)
            server.proc.wait(30)
            server.log.close()
        else:
            before = len(answered)  # a turn per client first: states on disk for the next server to load
            deadline = time.monotonic() + 60
            while len(answered) < before + CLIENTS * (1 + life) and time.monotonic() < deadline:
                time.sleep(0.05)
            caught.append(kill_while_writing(folder, server, clients))
            for c in clients:
                c.join(60)
        assert not any(c.is_alive() for c in clients)
        conversations = [c.messages for c in clients]
        lives.append(len(answered))
    lm = load_checkpoint(BUNDLED_MODEL, mode="off")
    wrong = [(asked[-1]["content"], content) for asked, content, _ in answered
             if content != split_think(detokenize(lm, plain_greedy(lm, template_tokens(lm, asked), MAX_TOKENS)))[0]]
    stderr = log.read_text()
    assert wrong == [], wrong
    assert len(answered) >= CLIENTS * (TURNS_AFTER + KILLS), lives
    # Every server after the first resumed turns from the files the killed one left (no memory tier).
    assert all(any(cached > 0 for _, _, cached in answered[a:b]) for a, b in zip(lives, lives[1:])), answered
    assert "prompt cache: removed" not in stderr, stderr  # atomic writes: a kill never leaves a damaged file
    assert "Traceback" not in stderr, stderr
    print(f"{len(answered)} answers equal cold runs; kills during a write: {caught}; temporary files left: "
          f"{sum(1 for p in folder.rglob('.tmp-*'))}; files: {sum(1 for p in folder.rglob('*.safetensors'))}")
