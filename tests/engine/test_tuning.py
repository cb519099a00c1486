"""Depth auto: `dyno tune` stores the measured best depth, generate uses it; else an estimate."""

import json
import os

from helpers.reference import plain_greedy
from helpers.run import dyno
from helpers.drafts import recording_drafter, replay
from speculative.measure.tuning import best_by_cost, expected_tokens_per_round



def test_best_by_cost_trades_acceptance_for_verify_cost():
    acceptance = [0.9, 0.8, 0.7, 0.1]
    cheap = {"T1": 1.0, "Td": 0.0, "Tv": {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}}
    dear = {"T1": 1.0, "Td": 0.0, "Tv": {1: 1.3, 2: 2.0, 3: 2.8, 4: 3.6}}
    assert expected_tokens_per_round(acceptance, 3) == 1 + 0.9 + 0.8 + 0.7
    assert best_by_cost(cheap, acceptance) == 3  # 3.4/1.3 beats 2.7/1.2 and 3.5/1.4
    assert best_by_cost(dear, acceptance) == 1  # 1.9/1.3 beats 2.7/2.0
    flat = {"T1": 1.0, "Td": 0.0, "Tv": {1: 1.0, 2: 1.38, 3: 1.8}}  # 1.9, 1.96, 1.89: within 5%
    assert best_by_cost(flat, acceptance) == 1


def test_best_by_cost_charges_each_head_step_in_units_of_T1():
    """E(k) / (Tv(k)/T1 + k*Td/T1) by hand: Tv/T1 = 1.1, 1.2, 1.3, 1.4 and E = 1.9, 2.7, 3.4, 3.5."""
    acceptance = [0.9, 0.8, 0.7, 0.1]
    tv = {1: 2.2, 2: 2.4, 3: 2.6, 4: 2.8}
    # Td/T1 = 0.1: 1.9/1.2, 2.7/1.4, 3.4/1.6 = 2.125, 3.5/1.8; nothing else within 5% of 2.125.
    assert best_by_cost({"T1": 2.0, "Td": 0.2, "Tv": tv}, acceptance) == 3
    # Td/T1 = 0.3: 1.36, 2.7/1.8 = 1.5, 3.4/2.2 = 1.545, 1.35: 2 is within 5% of 3 and shallower.
    assert best_by_cost({"T1": 2.0, "Td": 0.6, "Tv": tv}, acceptance) == 2
    # Td/T1 = 1: 1.9/2.1 = 0.905, 2.7/3.2 = 0.844, 0.791, 0.648.
    assert best_by_cost({"T1": 2.0, "Td": 2.0, "Tv": tv}, acceptance) == 1


def test_tune_then_auto_uses_stored_depth(tiny_dir, tmp_path):
    env = dict(os.environ, DYNO_CACHE=str(tmp_path))
    run = lambda *a: dyno(*a, env=env)  # noqa: E731
    tuned = run("tune", "--model", str(tiny_dir()), "--max-tokens", "20", "--pairs", "1")
    assert tuned.returncode == 0, tuned.stderr
    table = json.loads((tmp_path / "tune.json").read_text())
    (entry,) = table.values()
    assert entry["source"] == "measured" and entry["depth"] in (1, 2, 3, 4)
    assert f"stored depth {entry['depth']} for" in tuned.stdout
    out = run("generate", "--model", str(tiny_dir()), "--prompt", "x = 1", "--max-tokens", "10", "--json")
    assert json.loads(out.stdout)["speculative"]["draft_depth"] == entry["depth"]


def delivered_share(kept, n, depth):
    """Per draft position, the share of rounds that delivered an accepted draft there, when the rounds
    keep `kept` drafts and the run stops after `n` tokens (a round cut short delivers fewer)."""
    counts, out = [0] * depth, 1
    for a in kept:
        for i in range(min(a, n - out)):
            counts[i] += 1
        out += a + 1
    return [c / len(kept) for c in counts]


def test_estimate_weighs_depths_by_the_heads_measured_acceptance(monkeypatch, tmp_path):
    """`auto` without a stored tune (on the bundled model, whose head is trained) stores and uses the
    head's own acceptance from a short greedy run: per position, the share of rounds that kept a draft
    there, here replayed by hand from the drafts and plain greedy; the depth is best_by_cost on it."""
    from dyno_ui.paths import BUNDLED_MODEL
    from speculative.loader import load_checkpoint
    from speculative.depth import single_depth
    from speculative.measure.tuning import ESTIMATE_PROMPT, PRIOR_DECAY, PRIOR_FIRST

    lm = load_checkpoint(BUNDLED_MODEL, mode="mtp")
    monkeypatch.setenv("DYNO_CACHE", str(tmp_path))
    drafts = []
    depth = single_depth(lm, "auto", drafter=recording_drafter(drafts))
    (entry,) = json.loads((tmp_path / "tune.json").read_text()).values()

    prompt, tokens, k = lm.tokenizer.encode(ESTIMATE_PROMPT), 64, 4  # measured_acceptance's run
    reference = plain_greedy(lm, prompt, tokens + k, stop_at_eos=False)
    n = next((i + 1 for i, t in enumerate(reference[:tokens]) if t in lm.eos_token_ids), tokens)
    kept = replay([d.tolist() for d in drafts], reference, n)
    assert len(kept) == len(drafts) >= 8 and len(set(kept)) >= 3  # a profile that tells rules apart
    want = delivered_share(kept, n, k)
    assert want != [PRIOR_FIRST * PRIOR_DECAY**i for i in range(k)]
    assert entry["source"] == "estimate" and entry["acceptance"] == want
    costs = dict(entry["cost_model"], Tv={int(d): t for d, t in entry["cost_model"]["Tv"].items()})
    assert sorted(costs["Tv"]) == [1, 2, 3, 4]
    assert depth == entry["depth"] == best_by_cost(costs, want)


def test_a_stored_depth_belongs_to_its_draft_vocabulary(monkeypatch, tmp_path):
    """A depth tuned for one draft vocabulary is not used for another (a cheaper draft step can pay for
    a deeper draft); one stored before entries named the vocabulary is used for any, until re-tuned."""
    from types import SimpleNamespace

    from speculative.depth import single_depth
    from speculative.measure import tuning

    monkeypatch.setenv("DYNO_CACHE", str(tmp_path))
    lm = SimpleNamespace(path=tmp_path / "model", head=object())
    tuning.store(lm, 3, {"source": "measured"}, 1792)
    tuning.store(lm, 1, {"source": "measured"}, None)
    assert single_depth(lm, "auto", 1792) == 3 and single_depth(lm, "auto", None) == 1
    table = json.loads((tmp_path / "tune.json").read_text())
    assert sorted(e["draft_vocab"] or 0 for e in table.values()) == [0, 1792]
    legacy = {tuning.machine_key(lm).rsplit("|", 1)[0]: {"depth": 2, "source": "measured"}}
    (tmp_path / "tune.json").write_text(json.dumps(legacy))
    assert single_depth(lm, "auto", 1792) == 2 and single_depth(lm, "auto", None) == 2
