"""The draft vocabulary's ranking on disk: where it is stored, that it round-trips and is written
atomically, and that a missing, corrupt or unusable one costs one notice line, never a traceback."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from speculative.draft_vocab import rank as vocab_rank
from speculative.errors import DynoError
from speculative.heads.find import cached_head_path
from speculative.loader import load_checkpoint
from speculative.heads.mtp import read_checkpoint_head, write_head_folder

VOCAB = 320  # helpers.tiny_models.VOCAB


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh Dyno cache for this test (the ranking files of other tests stay out of it)."""
    monkeypatch.setenv("DYNO_CACHE", str(tmp_path / "dyno"))
    return tmp_path / "dyno"


@pytest.fixture
def fast(monkeypatch):
    """Short continuations: the ranking's quality is measured elsewhere (tools/draft_vocab.py)."""
    monkeypatch.setattr(vocab_rank, "TOKENS_PER_SEED", 12)


def fresh(folder, **kw):
    """A newly loaded model: its ranking is looked up again, not taken from another test's memory."""
    return load_checkpoint(folder, **kw)


def test_a_ranking_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    mass = rng.random(VOCAB)
    order = np.lexsort((np.arange(VOCAB), -mass))
    path = tmp_path / "r.safetensors"
    vocab_rank.save(path, order, mass)
    got = vocab_rank.load(path, VOCAB)
    assert np.array_equal(got.order, order)
    assert np.allclose(got.mass, mass, rtol=1e-6) and got.source == str(path)
    assert got.covered(VOCAB) == pytest.approx(1.0) and got.covered(10) == pytest.approx(
        np.sort(mass)[::-1][:10].sum() / mass.sum(), rel=1e-5)
    assert os.listdir(tmp_path) == ["r.safetensors"]  # no temporary file left


def test_writes_go_to_a_temporary_file_renamed_over_the_real_name(tmp_path, monkeypatch):
    path = tmp_path / "r.safetensors"
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((Path(src), Path(dst), Path(dst).exists()))
        assert vocab_rank.load(Path(src), VOCAB).order.shape == (VOCAB,)  # complete before it gets the name
        real_replace(src, dst)

    monkeypatch.setattr(vocab_rank.os, "replace", spy)
    vocab_rank.save(path, np.arange(VOCAB), np.ones(VOCAB))
    (src, dst, existed), = seen
    assert dst == path and not existed and src.parent == tmp_path and src.name.startswith(".") and not src.exists()


def test_a_failed_write_leaves_neither_the_file_nor_its_temporary(tmp_path, monkeypatch):
    import safetensors.numpy

    def half_written(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x08\x00\x00")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", half_written)
    with pytest.raises(OSError):
        vocab_rank.save(tmp_path / "r.safetensors", np.arange(VOCAB), np.ones(VOCAB))
    assert os.listdir(tmp_path) == []


def truncated(path):
    vocab_rank.save(path, np.arange(VOCAB), np.ones(VOCAB))
    path.write_bytes(path.read_bytes()[:-40])


@pytest.mark.parametrize("damage, problem", [
    (lambda p: p.write_bytes(b"not a safetensors file"), "not a readable ranking"),
    (lambda p: truncated(p), "not a readable ranking"),
    (lambda p: vocab_rank.save(p, np.arange(VOCAB - 1), np.ones(VOCAB - 1)), "made for a vocabulary of 319"),
    (lambda p: vocab_rank.save(p, np.zeros(VOCAB, dtype=np.int64), np.ones(VOCAB)), "not a permutation"),
    (lambda p: vocab_rank.save(p, np.arange(VOCAB), np.full(VOCAB, np.nan)), "not finite"),
])
def test_a_corrupt_ranking_is_one_notice_and_is_ranked_again(tiny_dir, cache, fast, damage, problem):
    lm = fresh(tiny_dir())
    path = vocab_rank.ranking_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    damage(path)
    with pytest.raises(DynoError, match=problem):
        vocab_rank.load(path, VOCAB)
    notices = []
    got = vocab_rank.ranking(lm, notices.append)
    assert len(notices) == 1 and f"{path} is unusable (" in notices[0] and problem in notices[0], notices
    assert "ranking it by this model's own outputs" in notices[0]
    assert got.mass is not None and got.source == str(path)
    assert np.array_equal(vocab_rank.load(path, VOCAB).order, got.order)  # replaced by a good one
    assert vocab_rank.ranking(lm, notices.append) is got and len(notices) == 1  # once per model


def test_a_missing_ranking_is_derived_once_and_stored_by_the_trunks_fingerprint(tiny_dir, cache, fast):
    lm = fresh(tiny_dir())
    notices = []
    first = vocab_rank.ranking(lm, notices.append)
    assert notices == [f"dyno: draft vocabulary: ranking it by this model's own outputs "
                       f"({len(vocab_rank.seed_prompts(lm.tokenizer))} continuations of 12 tokens, once)"]
    stored = list((cache / "draft-vocab").iterdir())
    assert [p.suffix for p in stored] == [".safetensors"] and first.source == str(stored[0])
    again = vocab_rank.ranking(fresh(tiny_dir()), notices.append)  # another load: read, not derived
    assert len(notices) == 1 and np.array_equal(again.order, first.order)
    other = vocab_rank.ranking_path(fresh(tiny_dir("untied-mha")))
    assert other.parent == stored[0].parent and other != stored[0]  # another trunk, another file


def test_a_cached_heads_ranking_is_stored_beside_it(tiny_dir, cache, fast):
    folder = tiny_dir()
    config = json.loads((folder / "config.json").read_text())
    cached = write_head_folder(cached_head_path("org/base"), read_checkpoint_head(folder), config["text_config"])
    lm = fresh(folder, mtp_head=str(cached))
    assert vocab_rank.ranking(lm, lambda m: None).source == str(cached / vocab_rank.FILE)
    assert (cached / vocab_rank.FILE).exists() and not (cache / "draft-vocab").exists()


def test_a_ranking_shipped_in_the_checkpoint_is_used_and_never_written(tiny_dir, cache, fast, tmp_path):
    import shutil

    folder = shutil.copytree(tiny_dir(), tmp_path / "model")
    mass = np.linspace(1, 2, VOCAB)
    vocab_rank.save(folder / vocab_rank.FILE, np.lexsort((np.arange(VOCAB), -mass)), mass)
    notices = []
    got = vocab_rank.ranking(fresh(folder), notices.append)
    assert notices == [] and got.source == str(folder / vocab_rank.FILE) and got.order[0] == VOCAB - 1
    (folder / vocab_rank.FILE).write_bytes(b"garbage")
    lm = fresh(folder)
    got = vocab_rank.ranking(lm, notices.append)
    assert len(notices) == 1 and f"{folder / vocab_rank.FILE} is unusable" in notices[0]
    assert got.source == str(vocab_rank.ranking_path(lm)) and (folder / vocab_rank.FILE).read_bytes() == b"garbage"


def test_a_failed_ranking_falls_back_to_the_id_order_in_one_line(tiny_dir, cache, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("out of memory\nmore detail")

    monkeypatch.setattr(vocab_rank, "derive", broken)
    notices = []
    got = vocab_rank.ranking(fresh(tiny_dir()), notices.append)
    assert got.mass is None and np.array_equal(got.order, np.arange(VOCAB))
    assert notices[-1] == ("dyno: draft vocabulary: cannot rank it (out of memory); "
                           "using the tokenizer's id order") and len(notices) == 2


def test_an_unwritable_cache_keeps_the_ranking_for_the_run(tiny_dir, cache, fast):
    cache.mkdir(parents=True)
    (cache / "draft-vocab").write_text("a file where the folder goes")
    notices = []
    got = vocab_rank.ranking(fresh(tiny_dir()), notices.append)
    assert got.mass is not None and len(notices) == 2
    assert notices[1].startswith("dyno: draft vocabulary: cannot store ") and notices[1].endswith("ranked for this run only")


def test_a_model_split_across_processes_ranks_by_id_without_files(tiny_dir, cache):
    lm = fresh(tiny_dir())
    lm.ranks = object()  # what distributed.Member.load sets
    notices = []
    assert vocab_rank.ranking(lm, notices.append).mass is None and notices == [] and not cache.exists()
