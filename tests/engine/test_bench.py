"""The benchmark's own logic: ratios, bounds, the cost model and the JSON record."""

import json
import os
import shutil
import sys
import time

import pytest

from helpers.run import dyno

import mlx.core as mx

from speculative.measure.bench import paired_benchmark, summarize
from speculative.measure.cost_model import interleaved, speedup_bound
from speculative.config import SamplingParams



def test_speedup_bound_and_summary():
    # E = 3 tokens per round, verify costs 1.5 T1, two head steps of 0.05 T1: 3 / 1.6
    assert speedup_bound(3.0, t1=0.02, tv=0.03, td=0.001, k=2) == pytest.approx(1.875)
    assert summarize([1.0, 3.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_cost_timings_are_round_robin_bursts():
    """Each sample is the difference of bursts of 2n and n back-to-back calls (their edges cancel),
    and the functions take turns, so a machine whose speed drifts biases none against another."""
    calls = []

    def builder(name, seconds):
        def build():
            calls.append(name)
            time.sleep(seconds)
            return mx.array(0)
        return build

    t = interleaved({"a": builder("a", 0.01), "b": builder("b", 0.03)}, reps=3, burst=2)
    assert calls == ["a", "b"] * 2 + ["a"] * 6 + ["b"] * 6 + ["a"] * 6 + ["b"] * 6 + ["a"] * 6 + ["b"] * 6
    assert 0.007 <= t["a"] < 0.015 and 0.025 <= t["b"] < 0.045  # seconds per call, not per burst


def test_paired_benchmark_ratios_are_per_pair(tiny_lm):
    lm = tiny_lm()
    prompt = lm.tokenizer.encode("def f(x):\n")
    res = paired_benchmark(lm, prompt, SamplingParams(max_tokens=30), depths=[2], pairs=3)
    mtp = res["settings"]["mtp@2"]
    assert len(mtp["ratios"]) == len(mtp["tps"]) == 3
    assert mtp["identical"] is True  # greedy pairs double as a correctness check
    assert mtp["ratio"]["min"] <= mtp["ratio"]["median"] <= mtp["ratio"]["max"]
    assert mtp["drafted"] == 2 * round(mtp["drafted"] / 2) and mtp["accepted"] <= mtp["drafted"]
    assert mtp["tokens_per_round"] >= 1.0
    assert res["settings"]["off"]["identical"] is True


def test_bench_json_record(tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = dyno("bench", "--model", str(tiny_dir()), "--suite", "edit", "--depths", "1,2,auto", "--pairs", "1",
             "--max-tokens", "20", "--json", str(out), "--plot", str(tmp_path / "chart"))
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    assert set(record) >= {"machine", "model", "commit", "settings", "results", "cost_model"}
    assert set(record["machine"]) >= {"platform", "mlx", "mlx_lm", "backend", "blas"}
    blas = record["machine"]["blas"]  # which BLAS the CPU's float32 products went through, and its file
    assert f"BLAS: {blas['name']} ({blas['path']})" in r.stdout.splitlines()
    if blas["reference"] and sys.platform.startswith("linux"):  # what that means for the figures, in one line
        assert sum(line.startswith("note: float32 products run compute-bound here") for line in r.stdout.splitlines()) == 1
    auto = record["settings"]["auto_depth"]
    assert 1 <= auto <= 4  # what --draft-depth auto resolves to, benchmarked as its own setting
    assert set(record["cost_model"]["Tv"]) == {"1", "2", str(auto)} and record["cost_model"]["T1"] > 0
    (res,) = record["results"]
    for name in ("off", "mtp@1", "mtp@2", f"auto(={auto})"):
        assert res["settings"][name]["identical"] is True
    assert res["settings"][f"auto(={auto})"]["depth"] == auto
    s = res["settings"]["mtp@2"]
    c = res["cost_model"]  # measured right after this prompt's pairs
    expected = s["tokens_per_round"] / (c["Tv"]["2"] / c["T1"] + 2 * c["Td"] / c["T1"])
    assert s["bound"] == pytest.approx(expected)
    assert s["efficiency"] == pytest.approx(s["ratio"]["median"] / s["bound"])
    assert "mtp@2" in r.stdout and "cost model: T1=" in r.stdout
    assert s["by_context"]["under_2k"]["rounds"] == s["rounds"] and s["parked_rounds"] == 0  # short prompts
    assert "by context: every round under 2k tokens of context, none parked (--json: by_context)" in r.stdout.splitlines()
    assert "Plotly.newPlot" in (tmp_path / "chart.html").read_text()
    if shutil.which("chromium") or shutil.which("google-chrome"):  # kaleido renders through the browser
        assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_reports_acceptance_by_context_band(tiny_lm, capsys):
    """A prompt past 2k tokens: its rounds are reported in the 2-8k band, in the record (what --json
    writes) and in the table, and the bands add up to the setting's rounds."""
    from dyno_ui.cli.bench import _print_table
    from speculative.measure.blas import detect

    lm = tiny_lm()
    prompt = lm.tokenizer.encode("# a long comment line\n" * 100)  # a byte per token: 2200
    res = paired_benchmark(lm, prompt, SamplingParams(max_tokens=20), depths=[2], pairs=1, with_off=False)
    s = res["settings"]["mtp@2"]
    bands = s["by_context"]
    assert bands["2k_8k"]["rounds"] == s["rounds"] > 0 and s["parked_rounds"] == 0
    assert sum(b["rounds"] for b in bands.values()) == s["rounds"]
    assert bands["2k_8k"]["acceptance_by_position"] == s["acceptance_by_position"]
    costs = {"T1": 0.01, "Tv": {"2": 0.012}, "Td": 0.001}  # (the table's last line; not measured here)
    _print_table({"machine": {"blas": detect().as_json()}, "cost_model": costs,
                  "results": [{"suite": "tasks", "prompt": "long", "temperature": 0.0, **res, "cost_model": costs}]})
    lines = capsys.readouterr().out.splitlines()
    acc = [f"{a:.2f}" for a in bands["2k_8k"]["acceptance_by_position"]]
    line = next(line for line in lines if line.split()[:1] == ["2k_8k"])
    assert line.split() == ["2k_8k", str(s["rounds"]), "rounds", f"{bands['2k_8k']['tokens_per_round']:.2f}", *acc]
    assert not [line for line in lines if line.startswith("by context:")]


def test_bench_bad_depths():
    r = dyno("bench", "--depths", "a,b", timeout=120)
    assert r.returncode == 2 and r.stderr == "dyno: error: --depths must be comma-separated integers or auto, got 'a,b'\n"


def test_table_pools_acceptance_over_prompts():
    """The table's acceptance by position weighs each prompt by its rounds (not the first prompt's)."""
    from dyno_ui.cli.bench import _aggregate

    def setting(rounds, acceptance):
        return {"depth": 2, "drafted": 2 * rounds, "acceptance_by_position": acceptance, "tokens_per_round": 2.0,
                "rounds": rounds, "accepted_per_position": [round(a * rounds) for a in acceptance],
                "drafted_per_position": [rounds, rounds],
                "ratio": {"median": 1.0, "min": 1.0, "max": 1.0}, "decode_tps": {"median": 1.0}, "identical": True}

    record = {"results": [{"suite": "code", "temperature": 0.0, "settings": {"mtp@2": setting(10, [1.0, 0.5])}},
                          {"suite": "code", "temperature": 0.0, "settings": {"mtp@2": setting(30, [0.5, 0.1])}}]}
    (row,) = _aggregate(record)
    assert row["acceptance"] == pytest.approx([(10 * 1.0 + 30 * 0.5) / 40, (10 * 0.5 + 30 * 0.1) / 40])


def test_concurrent_bench_runs_rows_together_with_identical_texts(tmp_path):
    """`dyno bench --concurrency`: four settings per width, greedy texts identical to mlx-lm's
    BatchGenerator, the depths the policy chose recorded."""
    out = tmp_path / "concurrent.json"
    env = dict(os.environ, DYNO_CACHE=str(tmp_path))
    r = dyno("bench", "--concurrency", "1,2", "--pairs", "1", "--max-tokens", "16", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    assert [res["concurrency"] for res in record["results"]] == [1, 2]
    for res in record["results"]:
        assert set(res["settings"]) == {"mlx-lm batch", "dyno plain", "dyno drafting", "dyno serial"}
        assert all(s["identical"] is True for s in res["settings"].values())
        assert sum(res["settings"]["dyno drafting"]["depths"].values()) > 0
        assert set(res["settings"]["dyno plain"]["depths"]) == {"0"}
    assert "dyno drafting" in r.stdout and "drafting / best of (serial, plain)" in r.stdout
    assert record["batch_costs"]["V"] and record["settings"]["serial_depth"] >= 1
