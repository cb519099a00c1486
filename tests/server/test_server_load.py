"""Load: 8 concurrent clients x 5 requests, serially with drafting and batched (--decode-concurrency 4).

Every response must be complete and be the greedy answer to its own prompt (no mixed streams).
"""

import logging
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.reference import plain_greedy
from helpers.serving import MODEL_ID, detokenize, running_server, split_think
from speculative.config import SpecConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLIENTS, REQUESTS, MAX_TOKENS = 8, 5, 12


def prompt_of(client: int, i: int) -> str:
    return f"# client {client}, request {i}\ndef task_{client}_{i}(x):\n"


def ask(running, client: int, i: int):
    """One request, alternating chat/completions and streamed/whole; returns (content, finish_reason)."""
    c, prompt, stream = running.client, prompt_of(client, i), (client + i) % 2 == 1
    if i % 2 == 0:
        kw = dict(model=MODEL_ID, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        if not stream:
            out = c.completions.create(**kw)
            return out.choices[0].text, out.choices[0].finish_reason
        chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
        return "".join(ch.text for ch in chunks), chunks[-1].finish_reason
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        out = c.chat.completions.create(**kw)
        return out.choices[0].message.content, out.choices[0].finish_reason
    chunks = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    return "".join(ch.delta.content or "" for ch in chunks), chunks[-1].finish_reason


@pytest.fixture(scope="module")
def expected(tiny_lm):
    """(content, finish_reason) of plain mlx-lm greedy decoding for every request."""
    lm = tiny_lm()
    out = {}
    for client in range(CLIENTS):
        for i in range(REQUESTS):
            text = prompt_of(client, i)
            prompt = (lm.tokenizer.encode(text) if i % 2 == 0 else lm.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))
            tokens = plain_greedy(lm, prompt, MAX_TOKENS)
            content = detokenize(lm, tokens)
            out[client, i] = (content if i % 2 == 0 else split_think(content)[0],
                              "stop" if tokens[-1] in lm.eos_token_ids else "length")
    return out


@pytest.mark.parametrize("concurrency", [1, 4], ids=["serial-mtp", "batched-4"])
def test_concurrent_clients_each_get_their_own_answer(tiny_dir, expected, caplog, concurrency):
    with running_server(tiny_dir(), SpecConfig("auto", 3), decode_concurrency=concurrency) as running:
        def client_session(client):
            return {(client, i): ask(running, client, i) for i in range(REQUESTS)}

        with caplog.at_level(logging.INFO, logger="dyno.serve"), ThreadPoolExecutor(CLIENTS) as pool:
            results = {}
            for answers in pool.map(client_session, range(CLIENTS)):
                results.update(answers)
        assert results == expected
        stats = running.stats()
        assert stats["requests"]["total"] == CLIENTS * REQUESTS
        assert stats["requests"]["failed"] == stats["requests"]["cancelled"] == 0
        assert running.get("/health").json()["status"] == "ok"
        lines = [r.getMessage() for r in caplog.records if r.name == "dyno.serve"]
        assert len(lines) == CLIENTS * REQUESTS
        if concurrency == 1:
            assert stats["speculative"]["mode"] == "mtp" and stats["speculative"]["rounds"] > 0
            assert all(re.match(r"MTP: \d+ tokens in \d+ rounds", line) for line in lines)
        else:  # batched: no drafting at all
            assert stats["speculative"]["mode"] is None and stats["speculative"]["rounds"] == 0
            assert all(line.startswith("Plain: ") for line in lines)
