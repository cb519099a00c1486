"""A seeded sampled request over a real socket gets plain mlx-lm's own text for its seed, whatever the
server runs beside it: the serial drafting server, plain batching (`--speculative off`, whose
BatchGenerator samples all rows from one generator, so a seeded request runs by itself) and batched
drafting, alone and beside 1, 3 and 7 other requests (greedy, unseeded and seeded with other seeds)."""

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from dyno_ui.paths import BUNDLED_MODEL
from helpers.serving import MODEL_ID, detokenize, running_server
from speculative.config import SpecConfig

pytestmark = pytest.mark.e2e

# top_k given, as the bundled model's generation_config would give 20 otherwise.
SEEDED = dict(prompt="def parse(line):\n    ", max_tokens=24, temperature=0.7, top_p=0.9, seed=2024,
              extra_body={"top_k": 40})
OTHERS = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.5, seed=3)]
TEXTS = ["class Node:\n", "import os\n", "for i in range(10):\n", "# sum\n"]
SERVERS = {"serial drafting": dict(spec=SpecConfig("mtp", 3)),
           "plain batching": dict(spec=SpecConfig("off"), decode_concurrency=8),
           "batched drafting": dict(spec=SpecConfig("mtp", 3), decode_concurrency=8, drafting_batch=True)}


def mlx_lm_text(lm) -> str:
    mx.random.seed(SEEDED["seed"])
    sampler = make_sampler(SEEDED["temperature"], SEEDED["top_p"], top_k=40)
    out = []
    for t, _ in generate_step(mx.array(lm.tokenizer.encode(SEEDED["prompt"])), lm.model,
                              max_tokens=SEEDED["max_tokens"], sampler=sampler):
        out.append(int(t))
        if out[-1] in lm.eos_token_ids:
            break
    return detokenize(lm, out)


@pytest.mark.parametrize("kind", SERVERS)
def test_a_seeded_request_is_mlx_lms_text_beside_any_others(kind):
    with running_server(BUNDLED_MODEL, **SERVERS[kind]) as server:
        want = mlx_lm_text(server.served.lm)
        client = server.client

        def seeded():
            return client.completions.create(model=MODEL_ID, **SEEDED).choices[0].text

        def other(i):
            return client.completions.create(model=MODEL_ID, prompt=TEXTS[i % 4], max_tokens=20 + 5 * i,
                                             **OTHERS[i % 3]).choices[0].text

        for beside in (0, 1, 3, 7):
            with ThreadPoolExecutor(beside + 1) as pool:
                others = [pool.submit(other, i) for i in range(beside)]
                got = pool.submit(seeded)
                assert got.result() == want, (kind, beside)
                assert all(f.result() is not None for f in others)
