"""/stats and /metrics report acceptance by context band and the share of rounds parked, from the
requests' own rounds (GenerationStats' bands: tests/engine/test_context_bands.py)."""

from dataclasses import replace

import pytest

from helpers.serving import MODEL_ID, running_server
from speculative.config import SpecConfig
from speculative.round import depth_policy
from speculative.round.depth_policy import BatchCosts, DepthPolicy
from speculative.stats import CONTEXT_BANDS

pytestmark = pytest.mark.e2e


def test_stats_and_metrics_report_acceptance_by_context_band_and_rounds_parked(tiny_dir, monkeypatch):
    """A drafting batch whose costs make drafting lose parks its row but for the policy's exploring
    turns: a short prompt's rounds land under 2k, a prompt past 2k tokens' in 2-8k; the parked rounds
    are the batch's depth-0 rounds, and each band's figures agree between /stats and /metrics."""
    monkeypatch.setattr(depth_policy, "EXPLORE_EVERY", 8)  # an exploring turn (3 rounds at depth 1) every 8
    costs = BatchCosts({1: {1: 1.0, 2: 10.0, 3: 10.0, 4: 10.0}}, {1: 0.01})
    spec = replace(SpecConfig("mtp", 3), policy=DepthPolicy(costs, [0.9, 0.9, 0.9], max_depth=3))
    with running_server(tiny_dir(), spec, decode_concurrency=2, drafting_batch=True) as server:
        long_prompt = "# a long comment line\n" * 100  # a byte per token: 2200 tokens
        assert len(server.served.lm.tokenizer.encode(long_prompt)) == 2200
        for prompt in ("def f(x):", long_prompt):
            server.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=30, temperature=0)
        stats, metrics = server.stats(), server.metrics()
    spec_stats = stats["speculative"]
    bands = spec_stats["by_context"]
    assert list(bands) == [name for name, _ in CONTEXT_BANDS]
    for band in ("under_2k", "2k_8k"):  # 30 tokens each: the prefill's, then 29 from rounds, each round its
        b = bands[band]  # accepted drafts and its closing token (the last one's cut by max_tokens, maybe)
        assert b["rounds"] + b["parked_rounds"] + b["accepted_tokens"] in (29, 30)
    assert bands["8k_32k"]["rounds"] == bands["over_32k"]["rounds"] == 0
    for key in ("rounds", "draft_tokens", "accepted_tokens", "parked_rounds"):
        assert sum(b[key] for b in bands.values()) == spec_stats[key]
    by_depth = stats["batch"]["rounds_by_depth"]  # one row at a time: a batch round is the row's round
    assert spec_stats["parked_rounds"] == by_depth["0"] > 0
    assert spec_stats["rounds"] == sum(n for k, n in by_depth.items() if k != "0") > 0
    assert spec_stats["parked_share"] == pytest.approx(by_depth["0"] / sum(by_depth.values()))
    assert metrics["mlx:spec_decode_parked_share"] == pytest.approx(spec_stats["parked_share"])
    for band, b in bands.items():
        label = f"{{band={band}}}"
        assert metrics[f"mlx:spec_decode_rounds_by_context_total{label}"] == b["rounds"]
        assert metrics[f"mlx:spec_decode_rounds_parked_by_context_total{label}"] == b["parked_rounds"]
        assert metrics[f"mlx:draft_tokens_by_context_total{label}"] == b["draft_tokens"]
        assert metrics[f"mlx:draft_tokens_accepted_by_context_total{label}"] == b["accepted_tokens"]
        if b["draft_tokens"]:
            assert metrics[f"mlx:draft_acceptance_by_context{label}"] == pytest.approx(b["acceptance"])
        else:  # undefined until that band drafts
            assert metrics[f"mlx:draft_acceptance_by_context{label}"] != metrics[f"mlx:draft_acceptance_by_context{label}"]
