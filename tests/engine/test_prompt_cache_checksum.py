"""A state restored from the disk tier is trusted only when its arrays match their checksum: a file
with flipped bytes in its arrays, a truncated one or one of another format version never serves;
the prompt is prefilled cold and the output equals a cold run."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from helpers.cache_files import flip_array_bytes, header
from helpers.reference import plain_greedy
from speculative.config import SamplingParams, SpecConfig
from speculative.engine import generate
from speculative.events import Token
from speculative.prompt_cache import disk
from speculative.prompt_cache.disk import prompt_store, read_header_and_tokens

SYSTEM, USER, NEXT = "# A module of small helpers.\n", "def mean(xs):\n    return", "\n# now the median\n"


def run(lm, prompt, n, cache=None, boundaries=()):
    events = list(generate(lm, prompt, SamplingParams(max_tokens=n), SpecConfig("mtp", 3),
                           prefix_cache=cache, boundaries=boundaries))
    return [e.id for e in events if isinstance(e, Token)], events[-1]


def one_file(lm, folder):
    """A turn whose state the disk tier keeps as its one file; (that file, the next turn's prompt)."""
    store = prompt_store(lm, max_bytes=0, folder=folder)  # every state goes to disk at once
    system, user = lm.tokenizer.encode(SYSTEM), lm.tokenizer.encode(USER)
    tokens, _ = run(lm, system + user, 9, store, [len(system)])
    store.close()
    (path,) = folder.rglob("*.safetensors")
    return path, system + user + tokens + lm.tokenizer.encode(NEXT)


def restarted(lm, folder, notices):
    return prompt_store(lm, max_bytes=10**9, folder=folder, notify=notices.append)


def test_flipped_array_bytes_are_caught_at_load_and_the_prompt_is_prefilled_cold(tiny_lm, tmp_path, monkeypatch):
    lm = tiny_lm()
    path, follow = one_file(lm, tmp_path / "cache")
    cold = plain_greedy(lm, follow, 12)
    before = header(path)
    assert flip_array_bytes(path)
    assert header(path) == before  # only array bytes changed: the index still reads the file
    damaged = path.read_bytes()
    notices = []
    store = restarted(lm, tmp_path / "cache", notices)
    assert list(store.disk.index) == [path] and notices == []  # not checked at startup
    tokens, done = run(lm, follow, 12, store)
    assert tokens == cold and done.reused_prompt_tokens == 0
    assert not path.exists() and store.disk.index == {}
    assert len(notices) == 1 and notices[0] == (
        f"dyno: prompt cache: removed {path}: its arrays do not match their checksum (the file was damaged)")
    # The same file trusted without its checksum: the flipped bytes change the answer, so the check
    # above is what kept it exact.
    path.write_bytes(damaged)
    monkeypatch.setattr(disk, "checksum", lambda arrays, meta: meta["sha256"])
    trusting = restarted(lm, tmp_path / "cache", [])
    tokens, done = run(lm, follow, 12, trusting)
    assert done.reused_prompt_tokens > 0 and tokens != cold


def resave(path, **changes):
    """Write `path` again with its metadata changed (a key set to None is left out)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    meta = {k: v for k, v in {**meta, **changes}.items() if v is not None}
    mx.save_safetensors(str(path), arrays, meta)


@pytest.mark.parametrize("damage", ["truncated at startup", "truncated after startup", "version 1", "version 3"])
def test_truncated_and_other_version_files_never_serve(tiny_lm, tmp_path, damage):
    lm = tiny_lm()
    path, follow = one_file(lm, tmp_path / "cache")
    cold = plain_greedy(lm, follow, 12)
    notices = []
    if damage == "truncated at startup":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "version 1":  # the layout before checksums
        resave(path, version="1", sha256=None)
    elif damage == "version 3":  # a newer Dyno's file: not ours to remove
        resave(path, version="3")
    store = restarted(lm, tmp_path / "cache", notices)
    if damage == "truncated after startup":
        assert list(store.disk.index) == [path]
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    tokens, done = run(lm, follow, 12, store)
    assert tokens == cold and done.reused_prompt_tokens == 0
    assert len(notices) == 1 and "\n" not in notices[0]
    if damage == "version 3":
        assert path.exists() and notices[0] == (
            f"dyno: prompt cache: ignoring {path}: written by format version 3, this Dyno reads version 2")
    else:
        assert not path.exists() and notices[0].startswith(f"dyno: prompt cache: removed {path}: ")
    if damage == "version 1":
        assert notices[0].endswith("written by format version 1, this Dyno reads version 2")
    elif damage.startswith("truncated"):
        assert "not a readable prompt cache file" in notices[0]


def test_the_checksum_covers_the_metadata_and_each_arrays_name_shape_and_bytes():
    arrays = {"a": mx.arange(12, dtype=mx.float32).reshape(3, 4), "b": mx.zeros((2, 0, 4), dtype=mx.bfloat16)}
    meta = {"format": disk.FORMAT, "checkpoints": "[3]"}
    base = disk.checksum(arrays, meta)
    assert disk.checksum(dict(arrays), dict(meta, sha256="anything")) == base
    assert disk.checksum({"a": arrays["a"][:, :2], "b": arrays["b"]}, meta) == disk.checksum(
        {"a": mx.array(np.arange(12, dtype=np.float32).reshape(3, 4)[:, :2]), "b": arrays["b"]}, meta)
    changed = [
        {**arrays, "a": arrays["a"].reshape(4, 3)},
        {**arrays, "a": arrays["a"] + mx.array([0, 0, 0, 1e-6])},
        {"c": arrays["a"], "b": arrays["b"]},
    ]
    assert all(disk.checksum(a, meta) != base for a in changed)
    assert disk.checksum(arrays, dict(meta, checkpoints="[4]")) != base


def test_a_written_file_holds_its_checksum_and_loads(tiny_lm, tmp_path):
    lm = tiny_lm()
    path, follow = one_file(lm, tmp_path / "cache")
    meta, _ = read_header_and_tokens(path)
    assert meta["version"] == disk.VERSION == "2" and len(meta["sha256"]) == 64
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "cache", copy)
    notices = []
    tokens, done = run(lm, follow, 12, restarted(lm, copy, notices))
    assert done.reused_prompt_tokens > 0 and tokens == plain_greedy(lm, follow, 12) and notices == []
