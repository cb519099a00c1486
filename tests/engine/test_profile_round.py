"""tools/profile_round.py's accounting: every phase of every round, contiguous, and the
instrumentation leaves the output untouched (plain greedy, token for token) and the driver's class as it was."""


import pytest

from helpers.reference import plain_greedy
from helpers.tools import load_tool
from speculative.batched import BatchSpeculator
from speculative.config import SamplingParams

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def tool():
    return load_tool("profile_round")


@pytest.mark.parametrize("depth", [1, 3])
def test_phases_add_up_and_output_is_plain_greedy(tiny_lm, tool, depth):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(PROMPT)
    n = 40
    params = SamplingParams(max_tokens=n)
    driver = {name: getattr(BatchSpeculator, name) for name in ("step", "_head", "_sync", "_emit", "target")
              if hasattr(BatchSpeculator, name)}
    on = tool.profile_run(lm, prompt, depth, params, barriers=True, skip=0)
    off = tool.profile_run(lm, prompt, depth, params, barriers=False, skip=0)
    # Nothing rebound: the tool passes a drafter, which wraps one driver instance's calls, not the class.
    assert {name: getattr(BatchSpeculator, name) for name in driver} == driver
    reference = plain_greedy(lm, prompt, n, stop_at_eos=False)
    assert on["tokens"] == off["tokens"] == reference
    assert len(on["phases"]) == len(on["walls"]) >= 3
    assert len(off["walls"]) >= 3 and off["phases"] == []
    for phases, wall in zip(on["phases"], on["walls"]):
        assert tuple(phases) == tool.PHASES
        assert all(host >= 0 and device >= 0 for host, device in phases.values())
        assert phases["verify"][1] > 0 and phases["drafts"][1] > 0  # the barriers waited on real work
        total = sum(host + device for host, device in phases.values())
        # The phases tile the round: from one round start to the next, nothing missed or counted twice.
        assert total == pytest.approx(wall, rel=1e-6, abs=1e-6)
    assert all(w > 0 for w in off["walls"])


def test_sampled_output_unchanged(tiny_lm, tool):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=30, seed=3)
    on = tool.profile_run(lm, prompt, 2, params, barriers=True)
    off = tool.profile_run(lm, prompt, 2, params, barriers=False)
    assert on["tokens"] == off["tokens"] and len(on["tokens"]) == 30


def test_round_floor_times_every_piece(tiny_lm):
    """tools/round_floor.py runs each piece on a model without the bundled ranking (a tiny random one)."""
    floor = load_tool("round_floor")
    lm = tiny_lm()
    t = floor.pieces(lm, lm.tokenizer.encode(PROMPT), 2, reps=1)
    assert set(t) == {"head, 1 row", "head, 3 rows", "greedy acceptance", "sampled acceptance",
                      "greedy draft pick", "sampled draft pick"}
    assert all(abs(s) < 1 for s in t.values())  # seconds; a difference of bursts, so noise can make it < 0
