"""`dyno generate` end to end in a subprocess: output, the summary line, JSON, and bad input."""

import argparse
import json
import re

import pytest

from helpers.run import dyno, dyno_each, launched_dyno, python

from helpers import tiny_models
from helpers.reference import plain_greedy
from dyno_ui.cli.generate import sampling_from
from dyno_ui.paths import BUNDLED_MODEL
from speculative.loader import load_checkpoint
from speculative.heads.find import MAKE_ONE

pytestmark = pytest.mark.e2e

SUMMARY = re.compile(r"^MTP: (\d+) tokens in (\d+) rounds \((\d+\.\d\d) per round\), (\d+)/(\d+) drafts accepted$")


def test_json_output_is_plain_greedy(tiny_dir, tiny_lm):
    prompt = "class Stack:\n    def push(self, item):\n"
    r = dyno("generate", "--model", str(tiny_dir()), "--prompt", prompt, "--max-tokens", "60",
             "--speculative", "mtp", "--draft-depth", "3", "--copies", "off", "--json")  # every round 3 head drafts
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    lm = tiny_lm()
    assert out["tokens"] == plain_greedy(lm, lm.tokenizer.encode(prompt), 60)
    assert len(out["provenance"]) == len(out["tokens"]) and set(out["provenance"]) <= {"draft", "model"}
    spec = out["speculative"]
    assert spec["mode"] == "mtp" and spec["draft_depth"] == 3
    assert spec["draft_tokens"] == 3 * spec["rounds"]
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    assert out["provenance"].count("draft") <= spec["accepted_tokens"]
    m = SUMMARY.match(r.stderr.strip().splitlines()[-1])
    assert m, r.stderr
    n, rounds, per, acc, drafted = m.groups()
    assert (int(n), int(rounds), int(acc), int(drafted)) == (
        len(out["tokens"]), spec["rounds"], spec["accepted_tokens"], spec["draft_tokens"])
    assert per == f"{spec['tokens_per_round']:.2f}" == f"{1 + spec['accepted_tokens'] / spec['rounds']:.2f}"
    assert set(out["timing"]) == {"prefill_s", "decode_s", "decode_tokens_per_s"}


def test_streamed_text_equals_json_text(tiny_dir):
    args = ["generate", "--model", str(tiny_dir("text-only")), "--prompt", "import os\n", "--max-tokens", "40"]
    streamed, as_json = dyno(*args), dyno(*args, "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout == json.loads(as_json.stdout)["text"] + "\n"


def test_auto_without_head_decodes_plainly(tmp_path):
    folder = tiny_models.build(tmp_path / "nohead", seed=1, with_head=False)
    r = dyno("generate", "--model", str(folder), "--prompt", "x = 1", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == ("dyno: decoding without drafts: no MTP head for nohead: it has no mtp.* tensors; "
                        "card: none (no README.md, no repo id); config hints: none; base_model chain: none; "
                        "shape table: no match; pass --mtp-head <folder>" + MAKE_ONE)
    assert lines[-1].startswith("Plain: 8 tokens, no drafting")


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty").mkdir()
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    tiny_models.build(root / "nohead", seed=1, with_head=False)
    return root


BAD_INPUT = [
    (["--model", "{root}/missing"], "model path not found: {root}/missing"),
    (["--model", "{root}/empty"], "not a model folder (no config.json): {root}/empty"),
    (["--model", "{root}/broken"], "model config {root}/broken/config.json is not valid JSON: "
                                   "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (["--model", "{root}/llama", "--speculative", "mtp"],
     "{root}/llama is a llama model; MTP drafting needs a Qwen3.5/3.6/3.8 model (model_type qwen3_5 or qwen3_5_moe)"),
    (["--model", "{root}/nohead", "--speculative", "mtp"],
     "no MTP head for nohead: it has no mtp.* tensors; card: none (no README.md, no repo id); config hints: none; "
     "base_model chain: none; shape table: no match; pass --mtp-head <folder>" + MAKE_ONE),
    (["--model", "{root}/nohead", "--mtp-head", "{root}/missing", "--speculative", "mtp"],
     "MTP head folder not found: {root}/missing"),
    (["--model", "{root}/nohead", "--mtp-head", "{root}/empty", "--speculative", "mtp"],
     "not an MTP head folder (no config.json): {root}/empty"),
    (["--model", "{root}/nohead", "--temp", "-1"], "invalid sampling value: temperature must be >= 0, got -1.0"),
    (["--model", "{root}/nohead", "--top-p", "0"], "invalid sampling value: top_p must be in (0, 1], got 0.0"),
    (["--model", "{root}/nohead", "--top-k", "-3"], "invalid sampling value: top_k must be an integer >= 0, got -3"),
    (["--model", "{root}/nohead", "--min-p", "2"], "invalid sampling value: min_p must be in [0, 1], got 2.0"),
    (["--model", "{root}/nohead", "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--model", "{root}/nohead", "--draft-depth", "9"], "draft depth must be an integer from 1 to 8, got 9"),
    (["--model", "{root}/nohead", "--draft-vocab", "0"], "draft vocabulary must be a number of tokens >= 1, auto or full, got 0"),
    (["--model", "{root}/nohead", "--draft-vocab", "most"],
     "draft vocabulary must be a number of tokens >= 1, auto or full, got 'most'"),
    (["--model", "{root}/nohead", "--prompt", ""], "the prompt is empty"),
]


def bad_generate(args, root):
    args = [a.format(root=root) for a in args]
    return ["generate", *args, *([] if "--prompt" in args else ["--prompt", "hello"])]


@pytest.fixture(scope="module")
def bad_input_runs(bad_models):
    """Each BAD_INPUT command's result, by its arguments: all run in one subprocess (helpers.run.dyno_each),
    one interpreter start-up and MLX import instead of one per case."""
    runs = dyno_each([bad_generate(args, bad_models) for args, _ in BAD_INPUT])
    return {tuple(args): r for (args, _), r in zip(BAD_INPUT, runs)}


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_one_line_exit_2(bad_models, bad_input_runs, args, message):
    r = bad_input_runs[tuple(args)]
    assert r.returncode == 2
    assert r.stderr == f"dyno: error: {message.format(root=bad_models)}\n"
    assert r.stdout == ""


def test_generate_with_an_automatic_draft_vocabulary_is_plain_greedy():
    from dyno_ui.paths import BUNDLED_MODEL

    prompt = "def parse(text):\n"
    runs = {v: dyno("generate", "--prompt", prompt, "--max-tokens", "40", "--temp", "0", "--speculative", "mtp",
                    "--draft-depth", "2", "--json", *(["--draft-vocab", v] if v else []))
            for v in ("auto", None, "full")}
    for r in runs.values():
        assert r.returncode == 0, r.stderr
    out = {v: json.loads(r.stdout) for v, r in runs.items()}
    lm = load_checkpoint(BUNDLED_MODEL)
    assert out["auto"]["tokens"] == plain_greedy(lm, lm.tokenizer.encode(prompt), 40) == out["full"]["tokens"]
    # the bundled model ships its ranking: auto is a subset from the first run, the default, and no notice
    assert out["auto"]["speculative"]["draft_vocab"] == out[None]["speculative"]["draft_vocab"] == 1792
    assert out["full"]["speculative"]["draft_vocab"] is None and "draft vocabulary" not in runs["auto"].stderr


@pytest.fixture(scope="module")
def bad_vocab_runs():
    """`dyno serve` and `dyno bench` with a bad draft vocabulary, in one subprocess (dyno_each)."""
    return dict(zip(("serve", "bench"), dyno_each([[c, "--draft-vocab", "most"] for c in ("serve", "bench")])))


@pytest.mark.parametrize("command", ["serve", "bench", "app.py"])
def test_a_bad_draft_vocabulary_is_one_line_exit_2_everywhere(bad_vocab_runs, command):
    r = python("app.py", "--draft-vocab", "most") if command == "app.py" else bad_vocab_runs[command]
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "dyno: error: draft vocabulary must be a number of tokens >= 1, auto or full, got 'most'\n"


def test_a_bad_device_is_one_line_exit_2(monkeypatch, capsys):
    """DYNO_DEVICE picks the MLX device (the suite pins its subprocesses to the CPU with it); in process,
    as main() is what the command runs."""
    from dyno_ui.cli import main

    monkeypatch.setenv("DYNO_DEVICE", "tpu")
    assert main(["generate", "--prompt", "x"]) == 2
    assert capsys.readouterr() == ("", "dyno: error: DYNO_DEVICE must be cpu or gpu, not 'tpu'\n")


def test_argparse_errors_exit_2():
    r = dyno("generate", "--speculative", "fast", "--prompt", "x")
    assert r.returncode == 2 and "invalid choice: 'fast'" in r.stderr and "Traceback" not in r.stderr


def test_sampling_defaults_from_generation_config():
    args = argparse.Namespace(temp=None, top_p=None, top_k=None, min_p=None, max_tokens=10, seed=None)
    gc = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    p = sampling_from(args, gc)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.95, 20, 0.0)
    args.temp = 0.0
    assert sampling_from(args, gc).greedy
    assert sampling_from(argparse.Namespace(**{**vars(args), "temp": None}), {**gc, "do_sample": False}).greedy


def test_generate_split_across_two_ranks_is_one_process_greedy():
    """`mlx.launch -n 2 ... dyno generate --distributed pipeline` on the bundled model (two local ranks
    on the ring backend): drafting on, and the tokens are one process's plain greedy tokens."""
    prompt = "def read_config(path):\n"
    r = launched_dyno("generate", "--distributed", "pipeline", "--prompt", prompt, "--max-tokens", "40",
                      "--temp", "0", "--draft-depth", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    lm = load_checkpoint(BUNDLED_MODEL, mode="off")
    assert out["tokens"] == plain_greedy(lm, lm.tokenizer.encode(prompt), 40)
    spec = out["speculative"]
    assert spec["mode"] == "mtp" and spec["draft_depth"] == 2 and spec["accepted_tokens"] > 0, spec
    assert r.stderr.count("MTP: 40 tokens in ") == 1  # rank 0 reports; the follower prints nothing


def test_generate_split_outside_mlx_launch_is_one_error_line():
    r = dyno("generate", "--distributed", "pipeline", "--prompt", "x", timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("dyno: error: cannot join the distributed group (") and r.stderr.count("\n") == 1
    assert "start every rank with mlx.launch" in r.stderr
