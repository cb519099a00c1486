"""Depth auto: `dyno tune` stores the measured best depth, generate uses it; else an estimate."""

import json
import os
import subprocess
import sys
from pathlib import Path

from speculative.tuning import best_by_cost, expected_tokens_per_round

ROOT = Path(__file__).resolve().parent.parent


def test_best_by_cost_trades_acceptance_for_verify_cost():
    acceptance = [0.9, 0.8, 0.7, 0.1]
    cheap = {"T1": 1.0, "Td": 0.0, "Tv": {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}}
    dear = {"T1": 1.0, "Td": 0.0, "Tv": {1: 1.3, 2: 2.0, 3: 2.8, 4: 3.6}}
    assert expected_tokens_per_round(acceptance, 3) == 1 + 0.9 + 0.8 + 0.7
    assert best_by_cost(cheap, acceptance) == 3  # 3.4/1.3 beats 2.7/1.2 and 3.5/1.4
    assert best_by_cost(dear, acceptance) == 1  # 1.9/1.3 beats 2.7/2.0
    flat = {"T1": 1.0, "Td": 0.0, "Tv": {1: 1.0, 2: 1.38, 3: 1.8}}  # 1.9, 1.96, 1.89: within 5%
    assert best_by_cost(flat, acceptance) == 1


def test_tune_then_auto_uses_stored_depth(tiny_dir, tmp_path):
    env = dict(os.environ, DYNO_CACHE=str(tmp_path))
    run = lambda *a: subprocess.run([sys.executable, "-m", "dyno_ui", *a], capture_output=True, text=True,
                                    cwd=ROOT, env=env, timeout=300)
    tuned = run("tune", "--model", str(tiny_dir()), "--max-tokens", "20", "--pairs", "1")
    assert tuned.returncode == 0, tuned.stderr
    table = json.loads((tmp_path / "tune.json").read_text())
    (entry,) = table.values()
    assert entry["source"] == "measured" and entry["depth"] in (1, 2, 3, 4)
    assert f"stored depth {entry['depth']} for" in tuned.stdout
    out = run("generate", "--model", str(tiny_dir()), "--prompt", "x = 1", "--max-tokens", "10", "--json")
    assert json.loads(out.stdout)["speculative"]["draft_depth"] == entry["depth"]


def test_estimate_measures_the_heads_acceptance():
    """`auto` without a stored tune weighs depths by the head's own acceptance on a short greedy run
    (on the bundled model, whose head is trained), not by the prior."""
    from dyno_ui.models import BUNDLED_MODEL
    from speculative.loader import load_model
    from speculative.tuning import ESTIMATE_PROMPT, measured_acceptance

    lm = load_model(BUNDLED_MODEL, mode="mtp")
    acc = measured_acceptance(lm, lm.tokenizer.encode(ESTIMATE_PROMPT), 4)
    assert len(acc) == 4 and acc[0] > 0.5
    assert all(a >= b for a, b in zip(acc, acc[1:]))  # position i is kept only if i - 1 was
