"""Heads for models that lost theirs: base_model chains, the local HF cache, ranged downloads
from a real HTTP server speaking the Hub's file protocol, offline mode, and failures."""

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import tiny_models
from helpers.reference import plain_greedy
from helpers.fake_hub import FakeHub
from helpers import run
from speculative.heads.find import PROMISE
from speculative.loader import load_checkpoint
from speculative.heads.tensors import read_header
from speculative.heads.find import MAKE_ONE

pytestmark = pytest.mark.e2e

SHARD = "model-00002-of-00002.safetensors"  # where tiny_models puts the head
PROMPT = "def add(a, b):\n    return a + b\n"


def card(base):
    return f"---\nbase_model: {base}\nlibrary_name: mlx\n---\n# a model\n"


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """org/original (raw HF, with head) <- org/finetune (no head) <- a local MLX conversion."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("repos")
    original = tiny_models.build(root / "original", **{k: v for k, v in tiny_models_config().items()})
    (original / "README.md").write_text("---\nlicense: apache-2.0\n---\n# original\n")
    finetune = root / "finetune"
    shutil.copytree(original, finetune)
    index = json.loads((finetune / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (finetune / "model.safetensors.index.json").write_text(json.dumps(index))
    (finetune / "README.md").write_text(card("org/original"))
    conversion = root / "conversion"
    convert(hf_path=str(original), mlx_path=str(conversion))
    (conversion / "README.md").write_text(card("org/finetune"))
    head_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0]
                     for n, e in read_header(original / SHARD).items() if n.startswith("mtp."))
    return {"original": original, "finetune": finetune, "conversion": conversion, "head_bytes": head_bytes}


def tiny_models_config():
    return {"seed": 1}


@pytest.fixture
def hub(repos):
    with FakeHub() as h:
        h.add("org/original", repos["original"])
        h.add("org/finetune", repos["finetune"])
        yield h


@pytest.fixture
def env(tmp_path, hub):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DYNO_"))}
    e.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "hf"), DYNO_CACHE=str(tmp_path / "dyno"),
             HF_HUB_DISABLE_TELEMETRY="1")
    return e


def dyno(env, *args, offline=False):
    e = dict(env, HF_HUB_OFFLINE="1") if offline else env
    return run.dyno(*args, env=e)


def generate(env, model, *extra, offline=False):
    return dyno(env, "generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "40",
                "--json", *extra, offline=offline)


def test_download_fetches_only_the_head_then_works_offline(repos, hub, env, tmp_path):
    r = generate(env, repos["conversion"], "--speculative", "mtp")
    assert r.returncode == 0, r.stderr
    assert "dyno: fetching the MTP head of org/original" in r.stderr and PROMISE in r.stderr
    out = json.loads(r.stdout)
    lm = load_checkpoint(repos["conversion"], mode="off")
    assert out["tokens"] == plain_greedy(lm, lm.tokenizer.encode(PROMPT), 40)
    assert out["speculative"]["mode"] == "mtp"
    # Bytes of safetensors bodies: the head's ranges plus two small header reads per shard: the
    # head's, and the one holding a conv1d weight (its shape says the checkpoint is raw HF).
    header = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in repos["original"].glob("*.safetensors"))
    sent = hub.body_bytes("org/original", ".safetensors")
    assert repos["head_bytes"] <= sent <= repos["head_bytes"] + header
    assert sent < 0.5 * (repos["original"] / SHARD).stat().st_size
    assert hub.body_bytes("org/finetune", ".safetensors") == 0
    cached = tmp_path / "dyno" / "mtp" / "org--original"
    config = json.loads((cached / "config.json").read_text())
    assert config["norms_shifted"] is True and config["base_model"] == "org/original"
    assert config["source"]["repo"] == "org/original" and config["source"]["via"] == "download"
    assert config["source"]["revision"] == hub.repos["org/original"][1]
    assert len(config["source"]["sha256"]) == 15
    # Second run: from the Dyno cache, offline, same output.
    hub.requests.clear()
    again = generate(env, repos["conversion"], "--speculative", "mtp", offline=True)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["tokens"] == out["tokens"] and hub.requests == []


def _fill_hf_cache(hf: Path, repo: str, folder: Path, commit: str):
    snap = hf / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    shutil.copytree(folder, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(commit)


def test_extracts_from_local_hf_cache_offline(repos, hub, env, tmp_path):
    for repo in ("org/original", "org/finetune"):
        _fill_hf_cache(tmp_path / "hf", repo, repos[repo.split("/")[1]], hub.repos[repo][1])
    r = generate(env, repos["conversion"], "--speculative", "mtp", offline=True)
    assert r.returncode == 0, r.stderr
    assert hub.requests == []  # offline: nothing touched the network
    config = json.loads((tmp_path / "dyno" / "mtp" / "org--original" / "config.json").read_text())
    assert config["source"]["via"] == "hf-cache"


def test_offline_with_nothing_cached(repos, env, tmp_path):
    r = generate(env, repos["conversion"], "--speculative", "mtp", offline=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "dyno: error: no MTP head for conversion: looked for org/finetune in "
        f"{tmp_path / 'dyno' / 'mtp'} and in the Hugging Face cache; HF_HUB_OFFLINE=1 prevents "
        "downloading it. Pass --mtp-head <folder>" + MAKE_ONE + "."
    )
    auto = generate(env, repos["conversion"], offline=True)
    assert auto.returncode == 0
    assert auto.stderr.splitlines()[0] == "dyno: decoding without drafts: " + r.stderr.splitlines()[-1][13:]
    assert json.loads(auto.stdout)["speculative"]["mode"] is None


def test_interrupted_download_leaves_nothing_and_retry_succeeds(repos, hub, env, tmp_path):
    hub.drop_after[SHARD] = 1000  # connection dies part-way through the head's byte range
    r = generate(env, repos["conversion"], "--speculative", "mtp")
    assert r.returncode == 2
    assert "was interrupted" in r.stderr or "was cut short" in r.stderr
    assert "Traceback" not in r.stderr
    mtp_dir = tmp_path / "dyno" / "mtp"
    assert not mtp_dir.exists() or list(mtp_dir.iterdir()) == []
    retry = generate(env, repos["conversion"], "--speculative", "mtp")
    assert retry.returncode == 0, retry.stderr
    assert (mtp_dir / "org--original" / "mtp.safetensors").exists()


def test_corrupt_range_detected(repos, hub, env, tmp_path):
    hub.corrupt.add(SHARD)
    r = generate(env, repos["conversion"], "--speculative", "mtp")
    assert r.returncode == 2
    assert "dyno: error: corrupt data for mtp." in r.stderr
    assert not (tmp_path / "dyno" / "mtp" / "org--original").exists()


def test_head_pull_list_and_models(repos, hub, env, tmp_path):
    pulled = dyno(env, "head", "pull", str(repos["conversion"]))
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.startswith(f"MTP head of org/original: {tmp_path / 'dyno' / 'mtp' / 'org--original'} (")
    listed = dyno(env, "head", "list")
    row = listed.stdout.splitlines()[1].split()
    assert row[0] == "org/original" and row[2] == "MB" and row[3] == "dense"
    assert row[4].startswith("org/original@") and row[-1] == "download"
    models = dyno(env, "models", str(repos["conversion"]), str(repos["original"]), offline=True)
    lines = {l.split()[0]: l for l in models.stdout.splitlines()[1:]}
    assert lines[str(repos["conversion"])].endswith("cached")
    assert lines[str(repos["original"])].endswith("in checkpoint")


SHARDS = ("model-00001-of-00002.safetensors", SHARD)
INDEX = "model.safetensors.index.json"


def _snapshot(hf: Path, repo: str, commit: str) -> Path:
    return hf / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


@pytest.mark.parametrize("missing", [0, 1], ids=["conv1d-shard", "mtp-shard"])
def test_partial_hf_cache_falls_back_to_download(repos, hub, env, tmp_path, missing):
    """A cached original lacking a shard extraction reads (the conv1d one decides the norm shift)
    is passed over for the ranged download, and drafting stays exact."""
    weight_map = json.loads((repos["original"] / INDEX).read_text())["weight_map"]
    assert weight_map[next(n for n in weight_map if n.endswith("linear_attn.conv1d.weight"))] == SHARDS[0]
    for repo in ("org/original", "org/finetune"):
        _fill_hf_cache(tmp_path / "hf", repo, repos[repo.split("/")[1]], hub.repos[repo][1])
    (_snapshot(tmp_path / "hf", "org/original", hub.repos["org/original"][1]) / SHARDS[missing]).unlink()
    r = generate(env, repos["conversion"], "--speculative", "mtp")
    assert r.returncode == 0, r.stderr
    assert "dyno: fetching the MTP head of org/original" in r.stderr
    out = json.loads(r.stdout)
    lm = load_checkpoint(repos["conversion"], mode="off")
    assert out["tokens"] == plain_greedy(lm, lm.tokenizer.encode(PROMPT), 40)
    assert out["speculative"]["mode"] == "mtp"
    config = json.loads((tmp_path / "dyno" / "mtp" / "org--original" / "config.json").read_text())
    assert config["source"]["via"] == "download"
    assert repos["head_bytes"] <= hub.body_bytes("org/original", SHARD)


def test_truncated_shard_in_hf_cache_names_the_fix(repos, hub, env, tmp_path):
    for repo in ("org/original", "org/finetune"):
        _fill_hf_cache(tmp_path / "hf", repo, repos[repo.split("/")[1]], hub.repos[repo][1])
    shard = _snapshot(tmp_path / "hf", "org/original", hub.repos["org/original"][1]) / SHARD
    shard.write_bytes(shard.read_bytes()[:4])
    r = generate(env, repos["conversion"], "--speculative", "mtp")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        f"dyno: error: safetensors file {shard} is truncated or not a safetensors file (4 bytes); delete that "
        f"file from the Hugging Face cache of org/original to download the head instead"]
    shard.unlink()  # the advice
    again = generate(env, repos["conversion"], "--speculative", "mtp")
    assert again.returncode == 0, again.stderr
    assert "dyno: fetching the MTP head of org/original" in again.stderr


def test_remote_shard_lacking_an_indexed_tensor(repos, hub, env, tmp_path):
    liar = Path(shutil.copytree(repos["original"], tmp_path / "liar"))
    index = json.loads((liar / INDEX).read_text())
    index["weight_map"]["mtp.fc.weight"] = SHARDS[0]
    (liar / INDEX).write_text(json.dumps(index))
    hub.add("org/liar", liar)
    url = f"{hub.url}/org/liar/resolve/{hub.repos['org/liar'][1]}/{SHARDS[0]}"
    message = f"{url} has no tensor mtp.fc.weight, which the {INDEX} of org/liar places there"
    r = generate(env, repos["conversion"], "--speculative", "mtp", "--mtp-base", "org/liar")
    assert r.returncode == 2 and r.stderr.splitlines() == [f"dyno: error: {message}"]
    auto = generate(env, repos["conversion"], "--mtp-base", "org/liar")
    assert auto.returncode == 0 and auto.stderr.splitlines()[0] == f"dyno: decoding without drafts: {message}"
    assert json.loads(auto.stdout)["speculative"]["mode"] is None
