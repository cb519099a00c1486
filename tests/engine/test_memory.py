"""Memory as mlx-lm handles it (speculative/backend/memory.py): the model wired while a generation decodes and
released after, MLX's buffer cache cleared after each prefill chunk and at mlx-lm's cadence in the
serial and batched drafting loops, mlx-lm's warning near the maximum recommended size, and default
budgets that leave the model its own bytes. Output is unchanged (test_greedy_equality, test_batched)."""

import pytest

from helpers.memory import WatchedMemory
from speculative.batched import BatchSpeculator
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token
from speculative.backend.memory import (
    MLX_MEMORY, Cadence, Memory, budget_notice, default_batch_memory, default_prompt_cache_bytes, device_memory,
    model_bytes, size_warning,
)
from speculative.prompt_cache.disk import prompt_store

GB, MB = 10**9, 2**20
PROMPT = list(range(5, 15))  # 10 tokens: prefill chunks (0, 4), (4, 8), (8, 9) at a step of 4, then the last token


def run(lm, watched, spec, max_tokens=40, stop_after=None):
    """generate() with `watched`'s memory, each token noted in its calls with whether the limit was held."""
    events = generate(lm, PROMPT, SamplingParams(max_tokens=max_tokens), spec, prefill_step=4, memory=watched.memory)
    held = []
    for event in events:
        if isinstance(event, Token):
            watched.calls.append("token")
            held.append(watched.wired)
            if len(held) == stop_after:
                events.close()
                break
    return held


def test_mlx_lm_cadence_by_default():
    """generate_step clears every 256 tokens, BatchGenerator every 512 rounds."""
    assert (Memory().tokens_between_clears, Memory().rounds_between_clears) == (256, 512)


@pytest.mark.parametrize("spec", [SpecConfig("mtp", 2), SpecConfig("off")], ids=["drafting", "plain"])
def test_a_generation_is_wired_while_it_decodes_and_released_after(tiny_lm, spec):
    watched = WatchedMemory()
    held = run(tiny_lm(), watched, spec)
    assert held and all(held)
    assert watched.calls[0] == "wire" and watched.calls[-1] == "unwire" and not watched.wired
    stopped = WatchedMemory()  # a consumer that stops early (a stop string, a cancel) releases it too
    assert run(tiny_lm(), stopped, spec, stop_after=3) == [True] * 3
    assert stopped.calls[-1] == "unwire" and not stopped.wired


def test_drafting_clears_after_each_prefill_chunk_and_every_n_tokens(tiny_lm):
    watched = WatchedMemory(tokens_between_clears=8)
    held = run(tiny_lm(), watched, SpecConfig("mtp", 2))
    calls = watched.calls
    first = calls.index("token")
    assert calls[:first] == ["wire", "clear", "clear", "clear"]  # one per prefill chunk, as mlx-lm's prefill
    seen, decode_clears = 0, []
    for call in calls[first:]:
        seen += call == "token"
        if call == "clear":
            decode_clears.append(seen)
    # The k-th clear comes with the round whose tokens pass 8k (a round emits at most depth + 1 = 3).
    assert len(decode_clears) == len(held) // 8 and len(held) >= 40
    assert all(8 * k - 3 <= before < 8 * k for k, before in enumerate(decode_clears, 1)), decode_clears


def test_batched_drafting_clears_every_n_rounds(tiny_lm):
    watched = WatchedMemory(rounds_between_clears=4)
    batch = BatchSpeculator(tiny_lm(), prefill_step=4, memory=watched.memory)
    for row in range(2):
        batch.join(row, PROMPT, SamplingParams(max_tokens=200))
    assert watched.calls == ["clear"] * 6  # each row's three prefill chunks
    for depth in [2, 0, 2, 1] * 3:  # plain rounds count as rounds, as BatchGenerator's steps
        batch.step(depth)
    assert len(batch) == 2 and watched.calls == ["clear"] * (6 + 3)


def test_no_wired_limit_where_the_device_reports_none():
    """Memory.wired takes nothing back where there was nothing to take (MLX's CPU backend)."""
    def never(limit):
        raise AssertionError("set_wired_limit called")

    with Memory(take_wired=lambda: None, set_wired=never).wired():
        pass
    with MLX_MEMORY.wired():  # the real calls, on whatever backend runs the tests
        pass


def test_cadence_clears_once_each_time_the_count_passes_a_multiple():
    cleared = []
    cadence = Cadence(4, lambda: cleared.append(cadence.count))
    for n in (1, 2, 1, 3, 5, 4):
        cadence.add(n)
    assert cleared == [4, 12, 16]


def test_warning_close_to_the_maximum_recommended_size():
    recommended = 16 * 2**30
    assert size_warning(int(0.9 * recommended), recommended) is None
    assert size_warning(recommended, None) is None  # no recommended size on this device: no warning
    assert size_warning(int(0.9 * recommended) + 1, recommended) == (
        "dyno: warning: the model takes 14745 MB, which is close to the maximum recommended size of 16384 MB; "
        "this can be slow (mlx-lm's work-arounds: https://github.com/ml-explore/mlx-lm/tree/main#large-models)")


def test_default_budgets_leave_the_model_its_bytes():
    assert default_prompt_cache_bytes(4 * GB, 20 * GB) == 2 * GB  # 1/8 of the 16 GB the model leaves
    assert default_batch_memory(4 * GB, 20 * GB) == 4 * GB  # 1/4 of it
    assert default_prompt_cache_bytes(30 * GB, 20 * GB) == default_batch_memory(30 * GB, 20 * GB) == 0


def test_the_prompt_cache_default_is_sized_for_the_loaded_model(tiny_lm):
    lm = tiny_lm()
    weights = model_bytes(lm.model, lm.head)
    assert weights == model_bytes(lm.model) + lm.head_memory.bytes > 0  # the head counted too
    assert prompt_store(lm).max_bytes == (device_memory() - weights) // 8


def test_notice_when_given_budgets_and_the_model_exceed_the_device():
    given = {"--prompt-cache-bytes": 6 * GB, "--max-batch-memory": 4 * GB}
    assert budget_notice(8 * GB, 20 * GB, given) is None  # 18 GB fit
    assert budget_notice(8 * GB, 16 * GB, {"--prompt-cache-bytes": 0}) is None  # no budget given
    assert budget_notice(8 * GB, 16 * GB, given) == (
        "dyno: warning: --prompt-cache-bytes 6.00 GB + --max-batch-memory 4.00 GB and the model's 8.00 GB "
        "exceed the 16.00 GB this device has for them; memory may swap")
