"""The local-model listing behind `dyno models` and the playground's Models tab: each model once."""

import os
from pathlib import Path

import pytest

from helpers.run import dyno

from dyno_ui.paths import BUNDLED_MODEL, local_folders
from speculative.heads.store import local_models

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").exists(), reason="needs the bundled model")


def _snapshot(cache: Path, repo: str, model: Path) -> Path:
    """A cached revision of `repo` whose files link to `model`'s (the hub's snapshots are links too)."""
    commit = "0" * 40
    snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in model.iterdir():
        (snap / f.name).symlink_to(f)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(commit)
    return snap


def test_the_bundled_model_is_listed_once_however_it_is_spelled(tmp_path, monkeypatch):
    link = tmp_path / "tiny-link"
    link.symlink_to(BUNDLED_MODEL)
    monkeypatch.chdir(ROOT)
    spellings = [BUNDLED_MODEL, Path("assets/dyno-tiny"), Path(f"{BUNDLED_MODEL}/."), link]
    rows = local_models(local_folders(spellings), notify=lambda m: None)
    bundled = [r for r in rows if Path(r[0]).resolve() == BUNDLED_MODEL.resolve()]
    assert bundled == [(str(BUNDLED_MODEL), "qwen3_5", "in checkpoint")]


def test_hugging_face_cache_models_are_listed_once_each(tmp_path):
    """`dyno models` on a Hugging Face cache holding a copy of dyno-tiny, that folder also given by hand and by
    its repo id; it is listed by its repo id, as `--model` takes it."""
    snap = _snapshot(tmp_path / "hf", "org/tiny-copy", BUNDLED_MODEL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DYNO_")) or k == "DYNO_DEVICE"}
    env.update(HF_HUB_CACHE=str(tmp_path / "hf"), DYNO_CACHE=str(tmp_path / "dyno"), HF_HUB_OFFLINE="1")
    r = dyno("models", str(snap), "org/tiny-copy", env=env)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == [str(BUNDLED_MODEL), "org/tiny-copy"], r.stdout
    assert all(row[1:] == ["qwen3_5", "in", "checkpoint"] for row in rows), r.stdout
