"""The scale benchmark's pieces: the draft vocabulary floor, one context."""

import re

import pytest
from helpers.tools import load_tool

from speculative.loader import load_checkpoint
from tools.standin import shapes
from tools.standin.random_checkpoint import scaled_down, write_checkpoint
from tools.standin.scale import draft_vocab_floor, measure_context, random_prompt


def test_draft_vocab_floor_is_autos():
    assert draft_vocab_floor(248320) == 31232


def test_one_context_is_exact_and_bounded(tmp_path):
    config = scaled_down(shapes.load("qwen3.5-0.8b")["text_config"])
    lm = load_checkpoint(write_checkpoint(tmp_path, config, seed=1), mode="mtp")
    record = measure_context(lm, random_prompt(32), [1, 2], (0.9, 0.7), max_tokens=24, pairs=2, reps=1, pair_reps=1)
    beside = record["cost_model_beside_pairs"]
    assert len(beside) == 2 and record["pair_reps"] == 1
    for k in (1, 2):
        d = record["depths"][k]
        assert d["identical"] and d["bound"] > 0 and d["efficiency"] > 0
        assert d["tokens_per_round"] == pytest.approx(1 + sum(d["acceptance_by_position"]))
        # each pair against the calls timed after it: its ratio over their bound at its own tokens per round
        pairs = d["paired"]["pairs"]
        assert [q["ratio"] for q in pairs] == d["ratios"]
        for q, c in zip(pairs, beside):
            calls = c["Tv"][k] + k * c["Td"]
            assert q["efficiency"] == pytest.approx(q["ratio"] * calls / c["T1"] / q["tokens_per_round"])
            assert 0 < q["round_over_calls"] and q["efficiency"] > 0
    assert set(record["cost_model"]) >= {"T1", "Tv", "Td", "Td_draft_vocab"}
    cost_only = measure_context(lm, random_prompt(32), [1, 2], (0.9, 0.7), 24, 1, 1, paired=False, padded_to=300)
    assert cost_only["depths"][2]["tokens_per_round"] == pytest.approx(2.6) and "plain" not in cost_only
    assert cost_only["context"] == 300 and cost_only["padded"]
    # auto's estimate: the shallowest depth within 5% of the best bound for the profile's acceptance
    bounds = {k: d["bound"] for k, d in cost_only["depths"].items()}
    assert cost_only["auto_estimate"] == min(k for k, b in bounds.items() if b >= 0.95 * max(bounds.values()))


def test_padding_grows_every_attention_cache(tiny_lm):
    from mlx_lm.models.cache import KVCache

    import mlx.core as mx
    from speculative.measure.cost_model import pad_attention

    lm = tiny_lm("tied-gqa2")
    trunk, head = lm.target.make_cache(), lm.head.make_cache()
    tokens = mx.array([[1, 2, 3, 4]])
    lm.head(lm.target.embed(tokens), lm.target.hidden(tokens, trunk), head)
    pad_attention(trunk + head, 700)
    kv = [c for c in trunk + head if isinstance(c, KVCache)]
    assert len(kv) == 2 and all(c.offset == 700 for c in kv)


def test_the_tool_builds_float32_and_names_its_blas(tmp_path, monkeypatch, capsys):
    """`--dtype float32` loads a float32 model (what the BLAS multiplies), and the record and the table
    header say which BLAS ran it; `--draft-vocab` drafts over a labelled subset of that many rows."""
    import json
    import os
    import signal

    tool = load_tool("scale_bench")
    out = tmp_path / "record.json"
    monkeypatch.setattr("sys.argv", ["scale_bench.py", "--shape", "qwen3.5-0.8b", "--scaled-down", "--dtype", "float32",
                                     "--draft-vocab", "300", "--depths", "1,2", "--context", "16", "--max-tokens", "6",
                                     "--pairs", "1", "--reps", "1", "--root", str(tmp_path), "--json", str(out)])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert tool.main() == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    r = capsys.readouterr()
    record = json.loads(out.read_text())
    assert record["dtype"] == "float32" and record["loaded_dtype"] == {"lm_head": "float32", "mtp_head": "float32"}
    blas = record["blas"]
    assert blas["name"] and os.path.isfile(blas["path"])
    header = r.out.splitlines()[:2]
    assert "float32" in header[0] and "drafts over 300 tokens" in header[0]
    assert header[1] == f"BLAS: {blas['name']} ({blas['path']})"
    assert re.search(r"auto's estimate \(cost model, the profile's acceptance\): depth [12]; the pairs' fastest: depth [12]$",
                     r.out, re.M)
    (context,) = record["contexts"]
    assert context["draft_vocab"] == {"tokens": 300, "ids": "special tokens, the reference run's tokens, then the lowest ids"}
    assert context["cost_model"]["draft_vocab_tokens"] == 300
    d = context["depths"]["2"]
    assert d["efficiency"] == pytest.approx(d["ratio"]["median"] / d["bound_draft_vocab"])
    # each pair's efficiency against the calls timed beside it (--pair-reps, 3 by default), over the subset
    (c,) = context["cost_model_beside_pairs"]
    (q,) = d["paired"]["pairs"]
    calls = c["Tv"]["2"] + 2 * c["Td_draft_vocab"]
    assert q["efficiency"] == pytest.approx(q["ratio"] * calls / c["T1"] / q["tokens_per_round"])
    assert re.search(r"beside each pair: plain's step [\d.]+ \([\d.]+-[\d.]+\)x T1; depth 1: efficiency ", r.out)
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # the checkpoint is gone


def test_the_tool_runs_dyno_tunes_procedure_with_replayed_drafts(tmp_path, monkeypatch, capsys):
    """`--tune`: dyno tune's paired benchmark on its own prompts, the drafts replayed to the profile (a
    random head would accept nothing), exact, and the depth it picks is its best median speedup."""
    import json
    import signal

    tool = load_tool("scale_bench")
    out = tmp_path / "record.json"
    monkeypatch.setattr("sys.argv", ["scale_bench.py", "--shape", "qwen3.5-0.8b", "--scaled-down", "--dtype", "float32",
                                     "--draft-vocab", "300", "--depths", "1,2", "--context", "16", "--max-tokens", "8",
                                     "--pairs", "1", "--reps", "1", "--tune", "--tune-pairs", "1", "--root",
                                     str(tmp_path), "--json", str(out)])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert tool.main() == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    t = json.loads(out.read_text())["tune"]
    assert t["depths"] == [1, 2] and t["pairs"] == 1 and t["max_tokens"] == 8
    speedup = {int(k): v for k, v in t["speedup"].items()}
    assert t["pick"] == max(speedup, key=speedup.get)
    # Replayed at 0.93/0.86: each depth's rounds keep drafts (a random head's would keep almost none).
    assert all(n > 1.5 for n in t["tokens_per_round"]["2"]) and all(n > 1.3 for n in t["tokens_per_round"]["1"])
    assert re.search(rf"^dyno tune's procedure \(the code suite's first two prompts, 8 tokens, 1 pairs, replayed\): "
                     rf"depth {t['pick']} \(1: [0-9.]+x, 2: [0-9.]+x\)$", capsys.readouterr().out, re.M)


def test_tune_pairs_below_one_are_refused(monkeypatch, capsys):
    tool = load_tool("scale_bench")
    monkeypatch.setattr("sys.argv", ["scale_bench.py", "--shape", "qwen3.5-0.8b", "--tune", "--tune-pairs", "0"])
    with pytest.raises(SystemExit) as e:
        tool.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "scale_bench.py: error: --tune-pairs must be at least 1: 0"


def test_a_kept_checkpoint_is_reused(tmp_path):
    import json

    import mlx.core as mx

    from tools.standin.random_checkpoint import built

    config = lambda: scaled_down(shapes.load("qwen3.5-0.8b")["text_config"])  # noqa: E731  (fresh: as a new run reads it)
    with built(config(), dtype=mx.float32, keep=str(tmp_path / "kept")) as (model, _):
        first = {p.name: p.stat().st_mtime_ns for p in model.iterdir()}
    with built(config(), dtype=mx.float32, keep=str(tmp_path / "kept")) as (model, _):
        assert {p.name: p.stat().st_mtime_ns for p in model.iterdir()} == first  # not written again
    with built(config(), dtype=mx.bfloat16, keep=str(tmp_path / "kept")) as (model, _):
        assert json.loads((model / "config.json").read_text())["torch_dtype"] == "bfloat16"  # another: written anew
    assert (tmp_path / "kept" / "dyno-random.json").exists()  # left in place


def test_batched_speed_at_a_shape_replays_drafts_and_times_the_decoding(tmp_path, monkeypatch, capsys):
    """tools/batched_speed.py --shape (scaled down): every method's tokens equal BatchGenerator's (the
    tool asserts it), the server's policy included, and the record has whole-run and decoding-phase
    rates for each, and the depths the policy ran at."""
    import json
    import sys

    tool = load_tool("batched_speed")
    out = tmp_path / "record.json"
    monkeypatch.setattr(sys, "argv", ["batched_speed.py", "--shape", "qwen3.5-0.8b", "--scaled-down", "--dtype",
                                      "float32", "--draft-vocab", "auto", "--rows", "2", "--depths", "0", "2",
                                      "--max-tokens", "10", "--repeats", "1", "--context", "8", "--policy", "--json", str(out)])
    tool.main()
    record = json.loads(out.read_text())
    assert record["blas"]["name"] and "qwen3.5-0.8b (float32" in record["label"]
    rows = record["results"]["2"]
    picked = rows.pop("policy_rounds_by_depth")
    assert set(rows) == {"batched depth 0", "batched depth 2", "batched, the server's policy",
                         "plain batched (mlx-lm BatchGenerator)"}
    assert sum(picked.values()) > 0 and all(0 <= int(k) <= 4 for k in picked)  # batch_cost.TIMED_DEPTH
    for r in rows.values():
        assert r["median"] > 0 and r["decode_median"] > 0
    assert rows["plain batched (mlx-lm BatchGenerator)"]["decode_vs_plain"] == 1.0
    assert "decode" in capsys.readouterr().out


def test_blas_rows_times_products_by_rows_and_names_its_blas(monkeypatch, capsys):
    """tools/blas_rows.py: one line naming the BLAS, then each shape's products by row count against one row."""
    tool = load_tool("blas_rows")
    monkeypatch.setattr("sys.argv", ["blas_rows.py", "--rows", "1,3", "--reps", "1", "--calls", "1"])
    assert tool.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("BLAS: ") and len(lines) == 1 + len(tool.SHAPES)
    for line, (k, n) in zip(lines[1:], tool.SHAPES):
        assert re.fullmatch(rf"\[rows, {k}\] x \[{k}, {n}\]: 1 rows [\d.]+ ms \(1\.00x\)  3 rows [\d.]+ ms \([\d.]+x\)", line)
    monkeypatch.setattr("sys.argv", ["blas_rows.py", "--rows", "0"])
    with pytest.raises(SystemExit) as e:
        tool.main()
    assert e.value.code == 2 and "--rows, --reps and --calls must be positive" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["blas_rows.py", "--rows", "1,x"])
    with pytest.raises(SystemExit) as e:
        tool.main()
    assert e.value.code == 2 and "--rows takes row counts separated by commas, e.g. 1,2,4: '1,x'" in capsys.readouterr().err
