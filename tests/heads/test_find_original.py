"""The original behind an MLX conversion found without a README: a snapshot mlx-lm downloaded has none
(its download patterns skip README.md) and mlx_lm.convert drops _name_or_path. The bundled pair:
assets/dyno-tiny (the original, whose index ships mtp.*) and assets/dyno-tiny-mlx (its conversion)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import run
from helpers.fake_hub import FakeHub
from helpers.reference import plain_greedy
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Round, Token
from speculative.heads import find
from speculative.loader import load_checkpoint
from speculative.heads.find import MAKE_ONE

ROOT = Path(__file__).resolve().parents[2]
ORIGINAL, CONVERSION = ROOT / "assets" / "dyno-tiny", ROOT / "assets" / "dyno-tiny-mlx"
BASE, MLX_REPO = "dyno-project/dyno-tiny", "mlx-community/dyno-tiny-mlx"  # the conversion's card names BASE
PROMPT = "def read_lines(path):\n"


def snapshot(hub_cache: Path, repo: str, folder: Path, rev: str = "0" * 40, readme: bool = False) -> Path:
    """`folder` as the Hugging Face cache holds a download of `repo`: models--ORG--NAME/snapshots/<rev>
    with refs/main; without README.md unless asked (mlx-lm's snapshot_download fetches none)."""
    repo_dir = hub_cache / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / rev
    shutil.copytree(folder, snap, ignore=None if readme else shutil.ignore_patterns("README.md"))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    return snap


def tiny_shape() -> dict:
    """The bundled model's figures, as a release entry lists them."""
    text = json.loads((CONVERSION / "config.json").read_text())["text_config"]
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "linear_num_key_heads", "linear_num_value_heads")
    return dict(moe=False, **{k: text[k] for k in keys})


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache and Dyno cache, offline; in-process."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DYNO_CACHE", str(tmp_path / "dyno"))
    return tmp_path / "hf"


def drafted_greedy(lm, n=40):
    """(tokens, accepted drafts) of a greedy drafting run, and mlx-lm's plain greedy tokens."""
    prompt = lm.tokenizer.encode(PROMPT)
    events = list(generate(lm, prompt, SamplingParams(max_tokens=n), SpecConfig("mtp", 3)))
    tokens = [e.id for e in events if isinstance(e, Token)]
    return tokens, sum(e.accepted for e in events if isinstance(e, Round)), plain_greedy(lm, prompt, n)


def test_card_of_the_snapshots_repo_names_the_original(tmp_path):
    """Online, a snapshot with no README: its repo (from the cache path) has a card on the Hub whose
    base_model is the original; Dyno fetches that card, then only the head."""
    with FakeHub() as hub:
        hub.add(MLX_REPO, CONVERSION)
        hub.add(BASE, ORIGINAL)
        home = tmp_path / "hf-home"
        model = snapshot(home / "hub", MLX_REPO, CONVERSION, hub.repos[MLX_REPO][1])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DYNO_"))}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), DYNO_CACHE=str(tmp_path / "dyno"),
                   HF_HUB_DISABLE_TELEMETRY="1")
        r = run.dyno("generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "40", "--json",
                     "--temp", "0", "--draft-vocab", "full", "--draft-depth", "3",  # no ranking or timing runs
                     env=env)
    assert r.returncode == 0, r.stderr
    assert f"dyno: fetching the MTP head of {BASE}" in r.stderr and "without drafts" not in r.stderr
    assert ("GET", MLX_REPO, "README.md", None) in hub.requests
    assert hub.body_bytes(MLX_REPO, ".safetensors") == 0  # the card, not the model, came from its repo
    out = json.loads(r.stdout)
    assert out["speculative"]["mode"] == "mtp" and out["speculative"]["accepted_tokens"] > 0
    lm = load_checkpoint(model, mode="off")
    assert out["tokens"] == plain_greedy(lm, lm.tokenizer.encode(PROMPT), 40)


def test_offline_without_a_card_the_shape_table_finds_the_original(offline_cache, tmp_path, monkeypatch):
    """Offline, no card anywhere, the original's full checkpoint in the Hugging Face cache: the
    release table matches the config's shape. Two releases share it (as the 27Bs do); the one whose
    head is here is taken, and the notice says it was a match by shape."""
    extra = tmp_path / "releases.json"
    extra.write_text(json.dumps({"releases": [
        {"repo": "dyno-project/dyno-tiny-twin", "shape": tiny_shape(), "sources": "test"},
        {"repo": BASE, "shape": tiny_shape(), "sources": "test"}]}))
    monkeypatch.setattr(find, "RELEASE_TABLES", getattr(find, "RELEASE_TABLES", []) + [extra], raising=False)
    snapshot(offline_cache, BASE, ORIGINAL, "1" * 40)
    model = snapshot(offline_cache, MLX_REPO, CONVERSION)
    lm = load_checkpoint(model)
    assert lm.head is not None, lm.notices
    assert lm.notices[0] == (
        f"dyno: no card or config names the original of {MLX_REPO}; its shape is that of {BASE} "
        f"(shape table), whose head it takes; pass --mtp-base ORG/NAME to choose another")
    source = json.loads((tmp_path / "dyno" / "mtp" / BASE.replace("/", "--") / "config.json").read_text())["source"]
    assert source["via"] == "hf-cache"
    tokens, accepted, plain = drafted_greedy(lm)
    assert tokens == plain and accepted > 0


def test_nothing_found_says_what_was_tried(offline_cache):
    """Offline, no card, no hint, no release of this shape: one notice that names each step and the flag."""
    model = snapshot(offline_cache, MLX_REPO, CONVERSION)
    lm = load_checkpoint(model)
    assert lm.head is None
    assert lm.notices == [
        f"dyno: decoding without drafts: no MTP head for {MLX_REPO}: it has no mtp.* tensors; "
        f"card of {MLX_REPO}: not in the Hugging Face cache (offline); config hints: none; "
        f"base_model chain: none; shape table: no match; pass --mtp-head <folder>" + MAKE_ONE]


def test_the_name_typed_finds_the_card(offline_cache, tmp_path):
    """A conversion in a plain folder, loaded by the name the user typed: that repo's card (here in the
    Hugging Face cache, offline) names the original, whose full checkpoint is cached too."""
    card = snapshot(offline_cache, MLX_REPO, CONVERSION, readme=True)
    for name in os.listdir(card):
        if name != "README.md":
            (card / name).unlink()  # only the card is cached for the conversion's repo
    snapshot(offline_cache, BASE, ORIGINAL, "1" * 40)
    model = tmp_path / "converted"
    shutil.copytree(CONVERSION, model, ignore=shutil.ignore_patterns("README.md"))
    assert load_checkpoint(model).head is None  # without the name: nothing names the original
    lm = load_checkpoint(model, repo_id=MLX_REPO)
    assert lm.head is not None and lm.head_source.startswith(str(tmp_path / "dyno" / "mtp")), lm.notices


OFFICIAL = {f"Qwen/Qwen3.5-{s}" for s in ("0.8B", "2B", "4B", "9B", "27B", "35B-A3B", "122B-A10B", "397B-A17B")} | {
    "Qwen/Qwen3.6-27B", "Qwen/Qwen3.6-35B-A3B", "Qwen/Qwen3.8-27B"}


def test_the_release_table_holds_the_official_releases_and_agrees_with_the_recorded_shapes():
    """Every official release once, with sources; each shape recorded in tools/standin/shapes
    matches its own release (and only releases of the same size)."""
    from tools.standin import shapes

    table = find.releases()
    assert sorted(r["repo"] for r in table) == sorted(OFFICIAL)
    assert all(r["sources"] and isinstance(r["uncertain"], list) and r["shape"]["vocab_size"] == 248320
               for r in table)
    for name in shapes.names():
        record = shapes.load(name)
        matched = find.shape_matches({"text_config": record["text_config"]})
        assert record["repo"] in matched, name
        size = record["repo"].split("-", 1)[1]
        assert all(m.split("-", 1)[1] == size for m in matched), (name, matched)
