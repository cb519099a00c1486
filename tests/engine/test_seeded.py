"""Seeded sampling as plain mlx-lm draws it: a seed's keys by position, and the draw that uses them."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token
from speculative.round.sampling import KeyChain, effective_top_k, seeded_pick

WARPS = [dict(temperature=0.3), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=20),
         dict(temperature=0.7, min_p=0.1), dict(temperature=1.0, top_p=0.8, top_k=50, min_p=0.02)]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("warp", WARPS, ids=str)
def test_a_positions_key_draws_what_mlx_lm_draws_at_that_step(warp, dtype):
    rows = (mx.random.normal((12, 1, 500), key=mx.random.key(3)) * 3).astype(dtype)
    params = SamplingParams(**warp, seed=42)
    sampler = make_sampler(params.temperature, params.top_p, params.min_p, top_k=effective_top_k(params, 500))
    mx.random.seed(42)
    plain = [sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)).item() for row in rows]
    keys = KeyChain(42)
    # Out of order, as rounds that draft, reject and draw again reach positions.
    order = [3, 0, 1, 2, 5, 4, 11, 6, 7, 9, 8, 10]
    picked = {i: seeded_pick(rows[i], params, keys[i]).item() for i in order}
    assert [picked[i] for i in range(12)] == plain
    assert len(set(plain)) > 3  # the rows really were sampled, not all argmax


def test_a_seeded_plain_generation_is_mlx_lms_own(tiny_lm):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode("def merge(a, b):\n")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=40)
    got = [e.id for e in generate(lm, prompt, params, SpecConfig(mode="off")) if isinstance(e, Token)]
    mx.random.seed(7)
    sampler = make_sampler(0.8, 0.95)
    want = [int(t) for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=40, sampler=sampler)]
    want = want[: next((i + 1 for i, t in enumerate(want) if t in lm.eos_token_ids), len(want))]
    assert got == want


# ---- drafting: the coupled round gives plain mlx-lm's seeded tokens at every depth ----

from dyno_ui.paths import BUNDLED_MODEL  # noqa: E402
from speculative.constraints import JsonSchema, constraint_for  # noqa: E402
from speculative.events import Round  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from speculative.round.processors import processors_for  # noqa: E402

PROMPT = "def parse(line):\n    "
SAMPLED = [dict(temperature=0.3, top_k=40), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, min_p=0.05)]


@pytest.fixture(scope="module")
def bundled():
    return load_checkpoint(BUNDLED_MODEL)


def mlx_lm_seeded(lm, prompt, params):
    """mlx_lm's own seeded generation: mx.random.seed, make_sampler, the request's processors."""
    mx.random.seed(params.seed)
    sampler = make_sampler(params.temperature, params.top_p, params.min_p,
                           top_k=effective_top_k(params, lm.vocab_size))
    out = []
    for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=params.max_tokens, sampler=sampler,
                              logits_processors=processors_for(params)):
        out.append(int(t))
        if out[-1] in lm.eos_token_ids:
            break
    return out


def drafted(lm, prompt, params, depth):
    events = list(generate(lm, prompt, params, SpecConfig(mode="mtp", draft_depth=depth)))
    rounds = [e for e in events if isinstance(e, Round)]
    return [e.id for e in events if isinstance(e, Token)], rounds


@pytest.mark.parametrize("warp", SAMPLED, ids=str)
def test_seeded_drafting_gives_mlx_lms_seeded_text_at_every_depth(bundled, warp):
    prompt = bundled.tokenizer.encode(PROMPT)
    params = SamplingParams(**warp, seed=1234, max_tokens=48)
    want = mlx_lm_seeded(bundled, prompt, params)
    for depth in (1, 2, 3, 4):
        got, rounds = drafted(bundled, prompt, params, depth)
        assert got == want, depth
        assert any(r.accepted for r in rounds) and any(r.accepted < r.drafted for r in rounds)


@pytest.mark.parametrize("extra", [dict(repetition_penalty=1.3), dict(logit_bias={11: 4.0, 198: -3.0}),
                                   "json"], ids=["repetition", "bias", "json"])
def test_seeded_drafting_with_processors_is_mlx_lms(bundled, extra):
    if extra == "json":
        extra = dict(constraint=constraint_for(JsonSchema({"type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"}}}), bundled))
    prompt = bundled.tokenizer.encode('{"name": ')
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=99, max_tokens=32, **extra)
    assert drafted(bundled, prompt, params, 3)[0] == mlx_lm_seeded(bundled, prompt, params)


@pytest.mark.parametrize("name", ["untied-mha", "moe-fused"])
def test_seeded_drafting_on_other_checkpoints_is_mlx_lms(tiny_lm, name):
    lm = tiny_lm(name)
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=32)
    assert drafted(lm, prompt, params, 2)[0] == mlx_lm_seeded(lm, prompt, params)


def test_a_seeded_row_gives_mlx_lms_text_beside_any_others_at_any_depths(bundled):
    """Alone and beside 1, 3 and 7 other rows (greedy, unseeded and seeded with other seeds), with the
    round's depth changing as the batch policy changes it (plain rounds included): the seeded row's
    tokens are plain mlx-lm's with its seed."""
    from speculative.batched import BatchSpeculator

    lm = bundled
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=2024, max_tokens=24)
    want = mlx_lm_seeded(lm, prompt, params)
    others = [SamplingParams(max_tokens=30), SamplingParams(temperature=1.0, max_tokens=50),
              SamplingParams(temperature=0.5, seed=3, max_tokens=20)]
    texts = ["class Node:\n", "import os\n", "for i in range(10):\n", "# sum\n"]
    for width, depths in ((1, [3]), (2, [1, 2, 0, 3]), (4, [2, 0, 0, 4, 1]), (8, [3, 1, 0, 2])):
        batch = BatchSpeculator(lm)
        events = {"seeded": list(batch.join("seeded", prompt, params).events)}
        for i in range(width - 1):
            batch.join(i, lm.tokenizer.encode(texts[i % 4]), others[i % 3])
        r = 0
        while "seeded" in batch:
            depth, then = depths[r % len(depths)], depths[(r + 1) % len(depths)]
            events["seeded"] += batch.step(depth, then).get("seeded", ((), None))[0]
            r += 1
        assert [e.id for e in events["seeded"] if isinstance(e, Token)] == want, width


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="row invariance holds on the CPU backend")
@pytest.mark.parametrize("others", [1, 3, 7])
def test_a_seeded_row_is_the_same_alone_and_beside_others_at_auto_depth(bundled, others):
    """As the server drafts under `auto`: each round's depth is a DepthPolicy's for the batch's width,
    learning acceptance from the rounds it observes and their times from the clock, so the depths
    follow the company and the machine. The seeded row's tokens are the same alone and beside
    `others` rows (greedy, unseeded, seeded with another seed, with processors; joining late, leaving
    early), and are plain mlx-lm's with its seed."""
    from speculative.batched import BatchSpeculator
    from speculative.round.depth_policy import BatchCosts, DepthPolicy, RoundTimer

    lm = bundled
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.8, top_k=40, seed=77, max_tokens=40)
    company = [SamplingParams(max_tokens=12), SamplingParams(temperature=1.0, max_tokens=60),
               SamplingParams(temperature=0.6, top_p=0.9, seed=8, max_tokens=25),
               SamplingParams(max_tokens=30, repetition_penalty=1.2)]
    texts = ["class Node:\n", "import os\n", "for i in range(10):\n", "# sum\n"]
    costs = BatchCosts(verify={w: {t: 0.01 * w * (1 + 0.4 * t) for t in range(1, 5)} for w in (1, 2, 4, 8)},
                       draft={w: 0.002 * w for w in (1, 2, 4, 8)})

    def run(n):
        policy = DepthPolicy(costs, [0.8, 0.6, 0.4], max_depth=4)
        timer, batch = RoundTimer(policy.record), BatchSpeculator(lm)
        joins = {0: list(range(n // 2)), 3: list(range(n // 2, n))}  # half beside it from the start, half later
        got = [e.id for e in batch.join("seeded", prompt, params).events if isinstance(e, Token)]
        depths, r = set(), 0
        while "seeded" in batch:
            for i in joins.get(r, []):
                batch.join(i, lm.tokenizer.encode(texts[i % 4]), company[i % 4])
            width = len(batch)
            depth, then = policy.depth_for(width), policy.peek(width)
            depths.add(depth)
            timer.start(width, depth, then)
            out = batch.step(depth, then)
            policy.observe(e for row in out.values() for e in row.events)
            got += [e.id for e in out.get("seeded", ((), None))[0] if isinstance(e, Token)]
            r += 1
        timer.skip()
        return got, depths

    alone, _ = run(0)
    beside, depths = run(others)
    assert alone == beside == mlx_lm_seeded(lm, prompt, params)
    assert len(depths) > 1  # the policy changed the depth on the way (plain rounds or other depths)
