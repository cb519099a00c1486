"""`dyno head tune` and `dyno head eval`: the unrolled head computes what drafting computes, a tune
resumes to the very head an uninterrupted one makes, the written head loads and leaves greedy text
unchanged, and bad input is one line, exit 2, nothing written."""

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from dyno_ui import cli
from helpers import tiny_models
from helpers.run import dyno
from speculative.measure import head_tune as tuning
from speculative.errors import DynoError
from speculative.loader import load_checkpoint

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(120))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune-data")
    (root / "train.txt").write_text(TEXT)
    (root / "held.jsonl").write_text("".join(json.dumps({"prompt": f"def g{i}(y):\n"}) + "\n" for i in range(2)))
    (root / "empty.txt").write_text("")
    return root


def test_unrolled_head_is_the_drafting_head(tiny_lm):
    """Chain p's step s from the batched unroll equals the head run as drafting runs it: a KV cache of the
    step-1 rows up to p, then its own outputs fed back one position further each step."""
    lm = tiny_lm()
    head = tuning.training_head(lm)
    wins = mx.array([[(7 * i + 3) % 250 + 1 for i in range(24)]])
    depth = 3
    t = tuning.targets(lm, wins, depth, top_k=8)
    lm_head = tuning.head_lm_head(lm)
    unrolled = tuning.unrolled(head, lm_head, t.embed, t.hidden, depth)
    for p in (0, 5, t.hidden.shape[1] - 1):
        cache = head.make_cache()
        h = head(t.embed[:, : p + 1], t.hidden[:, : p + 1], cache)[:, -1:]  # rows 0..p, as after prefill
        for s in range(1, depth + 1):
            np.testing.assert_allclose(np.array(lm_head(h)[0, 0]), np.array(unrolled[s - 1][0, p]), atol=2e-4,
                                       err_msg=f"chain {p}, step {s}")
            if s < depth:
                h = head(t.embed[:, p + s : p + s + 1], h, cache)


def _tune(lm, steps, state, stop_after=None):
    settings = tuning.TuneSettings(steps=steps, seq_len=32, batch=2, checkpoint_every=2, estimate_every=2)
    run = tuning.Tune(lm, lm.tokenizer.encode(TEXT), settings, state, {"test": 1})
    run.resume()
    for p in run.run():
        if stop_after is not None and p.step == stop_after:
            break  # a stop after the step-2 checkpoint: what Ctrl-C leaves
    return run


def test_resumed_tune_makes_the_same_head(tiny_lm, tmp_path):
    lm = tiny_lm()
    whole = _tune(lm, 4, tmp_path / "whole")
    _tune(lm, 4, tmp_path / "cut", stop_after=2)
    resumed = _tune(lm, 4, tmp_path / "cut")
    assert resumed.step == 4 and [e["step"] for e in resumed.log] == [0, 1, 2, 3, 4]
    want = dict(tree_flatten(whole.head.parameters()))
    for name, value in tree_flatten(resumed.head.parameters()):
        np.testing.assert_array_equal(np.array(value), np.array(want[name]), err_msg=name)
    assert any(not np.array_equal(np.array(v), np.array(dict(tree_flatten(lm.head.parameters()))[k]))
               for k, v in want.items())  # it did train


def test_a_stop_inside_a_step_goes_back_to_its_start(tiny_lm, tmp_path):
    """Ctrl-C lands mostly inside a step (its products): settle() puts head and optimizer back where the
    step began, so the checkpoint taken then agrees with the step count."""
    run = _tune(tiny_lm(), 2, tmp_path / "state")
    want = {k: np.array(v) for k, v in tree_flatten(run.head.parameters())}
    steps_done = int(run.opt.state["step"])
    loss, grads = run._grad(run.targets_at(2))
    run._before = (run.head.parameters(), tree_map(lambda x: x, run.opt.state))
    run.settled = False
    run.opt.update(run.head, grads)  # the step's update done, its count not yet: where a stop lands
    mx.eval(run.head.parameters(), run.opt.state)
    run.settle()
    assert run.settled and int(run.opt.state["step"]) == steps_done
    for name, value in tree_flatten(run.head.parameters()):
        np.testing.assert_array_equal(np.array(value), want[name], err_msg=name)


def test_tune_writes_a_head_that_loads_and_keeps_greedy_text(tiny_dir, data, tmp_path):
    out = tmp_path / "tuned"
    r = dyno("head", "tune", "--model", str(tiny_dir()), "--data", str(data / "train.txt"), "--out", str(out),
             "--steps", "3", "--seq-len", "32", "--batch", "2", "--eval-data", str(data / "held.jsonl"),
             "--eval-prompts", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"MTP head written to {out}: ")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "mtp.safetensors", "tune_log.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["format"] == "dyno-mtp-head" and config["norms_shifted"] is True
    assert len(config["tune"]["before"]["acceptance_by_position"]) == 3
    assert len(config["tune"]["after"]["acceptance_by_position"]) == 3
    assert "| before |" in (out / "README.md").read_text()
    assert not tuning.state_dir(out).exists()  # the checkpoint goes once the head is written
    args = ["generate", "--model", str(tiny_dir()), "--prompt", "def f(x):", "--max-tokens", "24", "--json"]
    plain = json.loads(dyno(*args, "--speculative", "off").stdout)
    drafted = dyno(*args, "--mtp-head", str(out), "--speculative", "mtp", "--draft-depth", "3")
    assert drafted.returncode == 0, drafted.stderr
    assert json.loads(drafted.stdout)["tokens"] == plain["tokens"]
    assert f"from {out}" in drafted.stderr


def test_eval_prints_acceptance_by_depth(tiny_dir, data):
    r = dyno("head", "eval", "--model", str(tiny_dir()), "--data", str(data / "held.jsonl"), "--depths", "1,2",
             "--max-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [(x["depth"], x["temperature"]) for x in out["results"]] == [(1, 0.0), (2, 0.0), (1, 0.7), (2, 0.7)]
    for x in out["results"]:
        assert len(x["acceptance_by_position"]) == x["depth"]
        assert x["tokens_per_round"] == pytest.approx(1 + sum(x["accepted_per_position"]) / x["rounds"])


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("bad-tune")
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "exists").mkdir()
    tiny_models.build(root / "narrow", seed=3, hidden_size=32)
    return root


BAD = [
    (["--data", "{data}/missing.txt"], "cannot read the data file {data}/missing.txt: No such file or directory"),
    (["--data", "{data}/empty.txt"], "the data file {data}/empty.txt is empty"),
    (["--data", "{data}/train.txt", "--out", "{bad}/exists"], "{bad}/exists exists; pass --overwrite to replace it"),
    (["--data", "{data}/train.txt", "--mtp-head", "{bad}/narrow"],
     "MTP head in {bad}/narrow does not fit this model: it was made for a hidden size of 32, the model has 64"),
    (["--data", "{data}/train.txt", "--model", "{bad}/llama"],
     "{bad}/llama is a llama model; MTP drafting needs a Qwen3.5/3.6/3.8 model (model_type qwen3_5 or qwen3_5_moe)"),
    (["--data", "{data}/train.txt", "--steps", "0"], "--steps must be a whole number of at least 1, got 0"),
    (["--data", "{data}/train.txt", "--mtp-head", "{bad}/exists", "--out", "{bad}/exists", "--overwrite"],
     "--out {bad}/exists is the head this tune starts from (--mtp-head); write the tuned head to another folder"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_is_one_line_and_writes_nothing(tiny_dir, data, bad, tmp_path, capsys, args, message):
    fill = lambda s: s.format(data=data, bad=bad)
    out = tmp_path / "out"
    argv = ["head", "tune", "--model", str(tiny_dir()), "--out", str(out)] + [fill(a) for a in args]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"dyno: error: {fill(message)}"
    assert sorted(Path(tmp_path).iterdir()) == []  # neither the head nor a checkpoint


def test_a_quantized_trunk_tunes_its_float_head(tmp_path):
    """A 4-bit trunk (mlx_lm.convert) with its head in a folder: the head's logits go through the trunk's
    quantized lm_head, and the float head learns."""
    model, head = tiny_models.quantized(tiny_models.build(tmp_path / "src", seed=1), tmp_path / "q", group_size=32, bits=4)
    lm = load_checkpoint(model, mode="mtp", mtp_head=str(head), head_bits=16)
    settings = tuning.TuneSettings(steps=2, seq_len=32, batch=2, estimate_every=10)
    run = tuning.Tune(lm, lm.tokenizer.encode(TEXT), settings, tmp_path / "state", {})
    start = {k: np.array(v) for k, v in tree_flatten(run.head.parameters())}
    losses = [p.loss for p in run.run()]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert any(not np.array_equal(np.array(v), start[k]) for k, v in tree_flatten(run.head.parameters()))


def _files(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _failing_swap(monkeypatch, target: Path):
    """os.replace failing when it moves the new head folder to `target` (after the old one was renamed
    aside): the moment an overwrite must not lose the old head. Other renames go through."""
    real = os.replace

    def replace(src, dst):
        if Path(dst) == target and not Path(src).name.startswith(f".{target.name}.old-"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_overwrite_keeps_the_old_head_until_the_new_one_is_in_place(tiny_lm, tmp_path, monkeypatch):
    from speculative.heads.mtp import HeadWeights, read_head_folder, write_head_folder

    lm = tiny_lm()
    weights = HeadWeights(dict(tree_flatten(lm.head.parameters())), True, "test")
    out = write_head_folder(tmp_path / "head", weights, lm.text_config, extra={"n": 1})
    before = _files(out)
    with monkeypatch.context() as m:
        _failing_swap(m, out)
        with pytest.raises(DynoError, match="cannot write the MTP head to .*No space left"):
            write_head_folder(out, weights, lm.text_config, extra={"n": 2})
    assert _files(out) == before  # renamed back, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temp or old folder left
    write_head_folder(out, weights, lm.text_config, extra={"n": 2})
    assert json.loads((out / "config.json").read_text())["n"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]
    assert read_head_folder(out).tensors.keys() == weights.tensors.keys()


def _tune_argv(tiny_dir, data, out):
    return ["head", "tune", "--model", str(tiny_dir()), "--data", str(data / "train.txt"), "--out", str(out),
            "--steps", "3", "--seq-len", "32", "--batch", "2", "--eval-data", str(data / "held.jsonl"),
            "--eval-prompts", "1", "--overwrite"]


def _old_head(tiny_lm, out):
    from speculative.heads.mtp import HeadWeights, write_head_folder

    lm = tiny_lm()
    write_head_folder(out, HeadWeights(dict(tree_flatten(lm.head.parameters())), True, "old"), lm.text_config,
                      extra={"old": True})
    return _files(out)


def test_a_tune_stopped_mid_way_leaves_the_previous_head(tiny_dir, tiny_lm, data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "tuned"
    old = _old_head(tiny_lm, out)
    real = tuning.Tune.run

    def stopped(self):
        for p in real(self):
            yield p
            if p.step == 2:
                raise KeyboardInterrupt  # Ctrl-C after step 2

    with monkeypatch.context() as m:
        m.setattr(tuning.Tune, "run", stopped)
        assert cli.main(_tune_argv(tiny_dir, data, out)) == 130
    assert _files(out) == old
    assert "tune stopped at step 2" in capsys.readouterr().err
    assert cli.main(_tune_argv(tiny_dir, data, out)) == 0  # resumes, then replaces the old head
    assert "resuming the tune from step 2 of 3" in capsys.readouterr().err
    assert "tune" in json.loads((out / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned"]  # checkpoint and old folder gone


def test_a_late_failure_keeps_the_previous_head_and_the_finished_tune(tiny_dir, tiny_lm, data, tmp_path,
                                                                       monkeypatch, capsys):
    """The write fails after every step is done: the old head stays, and the checkpoint of the last step is
    the resume point on purpose, so the rerun writes the head without training again."""
    out = tmp_path / "tuned"
    old = _old_head(tiny_lm, out)
    with monkeypatch.context() as m:
        _failing_swap(m, out)
        assert cli.main(_tune_argv(tiny_dir, data, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("trunk targets" in line for line in err)  # (the rerun must not compute them again)
    state = tuning.state_dir(out)
    assert err[-2] == f"dyno: the tuned head is kept in {state} (step 3); run the same command to write it, " \
                      f"or delete that folder to start over"
    assert err[-1].startswith(f"dyno: error: cannot write the MTP head to {out}: ")
    assert _files(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == [tuning.state_dir(out).name, "tuned"]
    kept = mx.load(str(state / tuning.STATE_WEIGHTS))
    assert cli.main(_tune_argv(tiny_dir, data, out)) == 0
    err = capsys.readouterr().err
    assert "resuming the tune from step 3 of 3" in err and "trunk targets" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuned"]
    written = mx.load(str(out / "mtp.safetensors"))
    for name, value in kept.items():  # the head written is the one the failed run had tuned
        if name.startswith("head."):
            want = written[f"mtp.{name[5:]}"]
            np.testing.assert_array_equal(np.array(want), np.array(value.astype(want.dtype)), err_msg=name)


def test_a_stopped_tunes_checkpoint_makes_a_head_folder(tiny_dir, tiny_lm, tmp_path):
    """tools/head_from_tune_checkpoint.py: the checkpoint's head, in the starting head's dtypes, loads as a head."""
    from helpers.run import python
    from speculative.heads.mtp import read_head_folder

    run = _tune(tiny_lm(), 2, tmp_path / "state")
    r = python("tools/head_from_tune_checkpoint.py", str(tmp_path / "state"), str(tmp_path / "head"),
               "--model", str(tiny_dir()))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"head of step 2 written to {tmp_path / 'head'}"
    head = read_head_folder(tmp_path / "head")
    assert json.loads((tmp_path / "head" / "config.json").read_text())["tune_checkpoint"]["step"] == 2
    start = dict(tree_flatten(tiny_lm().head.parameters()))
    for name, value in tree_flatten(run.head.parameters()):
        np.testing.assert_array_equal(np.array(head.tensors[name]), np.array(value.astype(start[name].dtype)),
                                      err_msg=name)
