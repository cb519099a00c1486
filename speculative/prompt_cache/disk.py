"""The prompt cache's disk tier: entries as safetensors files, reloaded on demand after a restart.

One folder per model under the cache folder, named by a fingerprint of the trunk's weights and
config (the head's fingerprint is stored in each file: head rows made by another head are left
out on load, the trunk state stays usable). A file holds the entry's tokens, its attention KV
rows, its recurrent states, its head rows and hidden, and its checkpoints; the metadata says
which model made it and how the arrays map onto the cache. Files are written to a temporary name
and renamed (os.replace), so a crash leaves no half file under a real name. Only the tokens and
the positions are read at startup (from the safetensors header); arrays are loaded when a prompt
can use them, and trusted only when they match the sha256 the metadata holds of them (and of the
rest of the metadata): a file damaged on disk (flipped bytes, a write the disk lost, truncation) is
removed with a one-line notice and the prompt is prefilled cold. Writes are not fsynced: a file a
power loss tore fails its checksum, and costs a prefill, never a wrong answer. A file of an older
format version is removed the same way when the index is read; one of a newer version, or that
another model made, is ignored (left to whoever wrote it). The folder has its own byte budget: the
least recently used files go first.
"""

import hashlib
import json
import os
import shutil
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from ..errors import DynoError, one_line
from ..backend.memory import model_bytes
from .store import (
    Checkpoint, PrefixCache, PrefixEntry, ShiftedKVCache, default_budget, is_attention, usable,
)

FORMAT = "dyno-prompt-cache"
VERSION = "2"  # 2: the sha256 of the arrays in the metadata (1 had none)
DISK_SHARE = 2  # the default disk budget: 1/2 of the free space at most,
DISK_MEMORY_MULTIPLE = 4  # and at most 4x the default memory budget
STALE_TEMP_S = 3600  # a temporary file this old is a crashed write: removed


def fingerprint(config: Optional[dict], module) -> str:
    """A hash of a module's parameter names, shapes, dtypes and the values at both ends of each,
    with its config: another model, a fine-tune or another quantization hashes differently."""
    h = hashlib.sha256(json.dumps(config or {}, sort_keys=True, default=str).encode())
    params = tree_flatten(module.parameters())
    samples = []
    for name, a in params:
        flat = a.reshape(-1)
        samples.append(mx.concatenate([flat[:32], flat[-32:]]).astype(mx.float32)
                       if mx.issubdtype(a.dtype, mx.floating) else mx.concatenate([flat[:32], flat[-32:]]))
    mx.eval(samples)
    for (name, a), sample in zip(params, samples):
        h.update(f"{name}:{a.shape}:{a.dtype};".encode())
        h.update(np.array(sample).tobytes())
    return h.hexdigest()


def model_keys(lm) -> Tuple[str, Optional[str]]:
    """(trunk fingerprint, head fingerprint or None) of a LoadedModel."""
    trunk = fingerprint(lm.config, lm.model)
    head = None
    if lm.head is not None:
        bits = lm.head_memory.bits if lm.head_memory is not None else None
        head = fingerprint({"bits": bits}, lm.head)
    return trunk, head


@dataclass
class Record:
    """What the index knows of a file without loading its arrays."""

    path: Path
    ids: np.ndarray
    positions: List[int]
    size: int
    used: float


class DiskTier:
    """Entries as files in `folder`/<trunk fingerprint>, within `max_bytes`."""

    def __init__(self, folder: Path, trunk_key: str, head_key: Optional[str], make_cache: Callable[[], List[Any]],
                 max_bytes: Optional[int] = None, notify: Optional[Callable[[str], None]] = None):
        self.root = Path(folder).expanduser()
        self.dir = self.root / trunk_key[:24]
        self.trunk_key, self.head_key = trunk_key, head_key
        self.make_cache = make_cache
        self.layout = ",".join("kv" if is_attention(c) else f"rec{len(c.cache)}" for c in make_cache())
        self.notify = notify or (lambda message: None)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.dir).free
        except OSError as e:
            raise DynoError(f"--prompt-cache-dir {self.root}: {e.strerror or one_line(e)}") from None
        if max_bytes is None:
            max_bytes = min(free // DISK_SHARE, DISK_MEMORY_MULTIPLE * default_budget())
        self.max_bytes = max_bytes
        self._index: Optional[Dict[Path, Record]] = None

    # ---- the index ----------------------------------------------------------------------

    @property
    def index(self) -> Dict[Path, Record]:
        """Every usable file of this model, read from the headers on first use."""
        if self._index is None:
            self._index = {}
            for path in sorted(self.dir.iterdir()):
                if path.name.startswith(".tmp-"):
                    self._remove_stale_temp(path)
                elif path.suffix == ".safetensors":
                    record = self._read_record(path)
                    if record is not None:
                        self._index[path] = record
        return self._index

    def _remove_stale_temp(self, path: Path) -> None:
        try:
            if time.time() - path.stat().st_mtime > STALE_TEMP_S:
                path.unlink()
        except OSError:
            pass

    def _read_record(self, path: Path) -> Optional[Record]:
        try:
            meta, tokens = read_header_and_tokens(path)
            stat = path.stat()
        except Exception as e:
            return self._drop(path, f"not a readable prompt cache file ({one_line(e)})", remove=True)
        verdict = self._verdict(meta)
        if verdict is not None:
            return self._drop(path, *verdict)
        return Record(path, tokens.astype(np.int64), positions(meta, len(tokens)), stat.st_size, stat.st_mtime)

    def _verdict(self, meta: Dict[str, str]) -> Optional[Tuple[str, bool]]:
        """None for a file this model can use, else (why not, whether to remove it): an older
        format version is ours to clear away; another format, a newer version or another model's
        file is left alone."""
        if meta.get("format") != FORMAT:
            return f"not a {FORMAT} file", False
        version = meta.get("version", "")
        if version != VERSION:
            older = version.isdigit() and int(version) < int(VERSION)
            return f"written by format version {version or '?'}, this Dyno reads version {VERSION}", older
        if meta.get("trunk") != self.trunk_key or meta.get("layout") != self.layout:
            return "made by another model", False
        return None

    def _drop(self, path: Path, problem: str, remove: bool) -> None:
        """Forget `path` with a one-line notice; `remove`: delete it too (it can never serve)."""
        if self._index is not None:
            self._index.pop(path, None)
        if remove:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                remove = False
        self.notify(f"dyno: prompt cache: {'removed' if remove else 'ignoring'} {path}: {problem}")
        return None

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.index.values())

    def best(self, prompt: np.ndarray, than: int) -> Optional[Record]:
        """The file usable for the longest prefix of `prompt`, if longer than `than`."""
        found, at = None, than
        for record in self.index.values():
            u = usable(record.ids, record.positions, prompt)
            if u > at:
                found, at = record, u
        return found

    # ---- reading and writing -------------------------------------------------------------

    def load(self, record: Record) -> Optional[PrefixEntry]:
        """The entry a file holds, or None (with a notice) when it cannot be used: its arrays are
        trusted only when they match the checksum written with them."""
        try:
            arrays, meta = mx.load(str(record.path), return_metadata=True)
        except Exception as e:
            return self._drop(record.path, f"not a readable prompt cache file ({one_line(e)})", remove=True)
        verdict = self._verdict(meta)
        if verdict is not None:
            return self._drop(record.path, *verdict)
        try:
            if meta.get("sha256") != checksum(arrays, meta):
                raise ValueError("its arrays do not match their checksum (the file was damaged)")
            entry = decode(arrays, meta, self.make_cache(), meta.get("head") == (self.head_key or ""))
        except Exception as e:  # a damaged file (truncated, bytes flipped) or one that cannot fit this model
            return self._drop(record.path, one_line(e), remove=True)
        entry.saved = True
        record.used = time.time()
        try:
            os.utime(record.path)
        except OSError:
            pass
        return entry

    def save(self, entry: PrefixEntry) -> None:
        """Write `entry` atomically, drop the files it makes redundant, keep within the budget."""
        path = self.dir / f"{file_id(entry)}.safetensors"
        temp = self.dir / f".tmp-{uuid.uuid4().hex}.safetensors"
        try:
            arrays, meta = encode(entry, self.trunk_key, self.head_key, self.layout)
            if sum(a.nbytes for a in arrays.values()) > self.max_bytes:
                return
            mx.save_safetensors(str(temp), arrays, meta)
            os.replace(temp, path)
        except Exception as e:  # a full disk, a folder gone: the request that evicted it goes on
            self.notify(f"dyno: prompt cache: cannot write {path}: {one_line(e)}")
            temp.unlink(missing_ok=True)
            return
        entry.saved = True
        index = self.index
        ids = np.asarray(entry.tokens, dtype=np.int64)
        stat = path.stat()
        index[path] = Record(path, ids, entry.positions(), stat.st_size, stat.st_mtime)
        for other in list(index.values()):  # a file whose every state the new one holds
            n = len(other.ids)
            if (other.path != path and n <= len(ids) and (n == len(ids) or n in entry.checkpoints)
                    and np.array_equal(other.ids, ids[:n]) and set(other.positions) <= set(entry.positions())):
                self._delete(other)
        while self.nbytes > self.max_bytes and len(index) > 1:
            self._delete(min((r for r in index.values() if r.path != path), key=lambda r: r.used))

    def _delete(self, record: Record) -> None:
        self.index.pop(record.path, None)
        try:
            record.path.unlink()
        except OSError:
            pass


def file_id(entry: PrefixEntry) -> str:
    h = hashlib.sha256(np.asarray(entry.tokens, dtype=np.int32).tobytes())
    h.update(b"head" if entry.head_cache is not None else b"trunk")
    return h.hexdigest()[:32]


def positions(meta: Dict[str, str], n: int) -> List[int]:
    return sorted(set(json.loads(meta.get("checkpoints", "[]"))) | {n})


def read_header_and_tokens(path: Path) -> Tuple[Dict[str, str], np.ndarray]:
    """The metadata and the `tokens` tensor of a safetensors file, without reading anything else."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 * 2**20:
            raise ValueError("header too large")
        header = json.loads(f.read(length))
        info = header["tokens"]
        if info["dtype"] != "I32":
            raise ValueError("tokens are not int32")
        begin, end = info["data_offsets"]
        f.seek(8 + length + begin)
        data = f.read(end - begin)
        if len(data) != end - begin:
            raise ValueError("truncated")
        size = path.stat().st_size
        if 8 + length + max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__") > size:
            raise ValueError("truncated")
    return header.get("__metadata__", {}), np.frombuffer(data, dtype=np.int32)


def _kv(cache) -> Tuple[int, Optional[mx.array], Optional[mx.array]]:
    """(start, keys, values) of an attention cache, rows trimmed to its length."""
    start, inner = (cache.start, cache.rows) if isinstance(cache, ShiftedKVCache) else (0, cache)
    if inner.keys is None or inner.offset == 0:
        return start + inner.offset, None, None
    return start, inner.keys[..., : inner.offset, :], inner.values[..., : inner.offset, :]


def encode(entry: PrefixEntry, trunk_key: str, head_key: Optional[str], layout: str):
    """(arrays, metadata) of an entry for mx.save_safetensors."""
    arrays = {"tokens": mx.array(entry.tokens, dtype=mx.int32)}
    for i, c in enumerate(entry.trunk_cache):
        if is_attention(c):
            _, k, v = _kv(c)
            if k is not None:
                arrays[f"trunk.{i}.keys"], arrays[f"trunk.{i}.values"] = k, v
        else:
            arrays.update({f"trunk.{i}.{j}": a for j, a in enumerate(c.cache) if a is not None})
    starts = []
    for i, c in enumerate(entry.head_cache or ()):
        start, k, v = _kv(c)
        starts.append(start)
        if k is not None:
            arrays[f"head.{i}.keys"], arrays[f"head.{i}.values"] = k, v
    if entry.last_hidden is not None:
        arrays["last_hidden"] = entry.last_hidden
    hidden_at = []
    for p, cp in entry.checkpoints.items():
        for i, layer in enumerate(cp.recurrent):
            arrays.update({f"cp.{p}.{i}.{j}": a for j, a in enumerate(layer or ()) if a is not None})
        if cp.hidden is not None:
            arrays[f"cp.{p}.hidden"] = cp.hidden
            hidden_at.append(p)
    meta = {
        "format": FORMAT, "version": VERSION, "trunk": trunk_key, "layout": layout,
        "head": (head_key or "") if entry.head_cache is not None else "",
        "head_layers": str(len(entry.head_cache or ())), "head_starts": json.dumps(starts),
        "checkpoints": json.dumps(sorted(entry.checkpoints)), "hidden_at": json.dumps(sorted(hidden_at)),
    }
    meta["sha256"] = checksum(arrays, meta)
    return arrays, meta


def checksum(arrays: Dict[str, mx.array], meta: Dict[str, str]) -> str:
    """sha256 of the metadata (but this sum) and of each array's name, dtype, shape and bytes in
    name order: what a file's arrays must hash to before its state is trusted."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(arrays):
        a = arrays[name]
        data = memoryview(a)  # (evaluates it)
        if not data.c_contiguous:  # a cache's rows sliced out of its larger buffer: one copy at a time
            data = memoryview(mx.contiguous(a))
        h.update(f"{name}:{str(a.dtype).rsplit('.', 1)[-1]}:{tuple(a.shape)};".encode())
        if data.nbytes:  # (a view with a zero in its shape cannot be cast)
            h.update(data.cast("B"))
    return h.hexdigest()


def decode(arrays: Dict[str, mx.array], meta: Dict[str, str], template: List[Any], head_ok: bool) -> PrefixEntry:
    """The entry `encode` wrote, built on `template` (the model's empty cache); raises on any mismatch."""
    tokens = tuple(int(t) for t in np.array(arrays["tokens"]))
    n = len(tokens)

    def kv(prefix: str, rows: int, start: int = 0):
        cache = KVCache()
        if rows:
            k, v = arrays[f"{prefix}.keys"], arrays[f"{prefix}.values"]
            if k.shape[-2] != rows or v.shape[-2] != rows:
                raise ValueError(f"{prefix} holds {k.shape[-2]} rows, not {rows}")
            cache.keys, cache.values, cache.offset = k, v, rows
        return ShiftedKVCache(start, cache) if start else cache

    def recurrent(prefix: str, layer) -> Tuple[mx.array, ...]:
        return tuple(arrays[f"{prefix}.{j}"] for j in range(len(layer.cache)))

    trunk = []
    for i, c in enumerate(template):
        if is_attention(c):
            trunk.append(kv(f"trunk.{i}", n))
        else:
            c.cache = list(recurrent(f"trunk.{i}", c))
            trunk.append(c)
    head, hidden = None, arrays.get("last_hidden")
    if head_ok and int(meta.get("head_layers", "0")):
        starts = json.loads(meta["head_starts"])
        head = [kv(f"head.{i}", max(n - 1 - s, 0), s) for i, s in enumerate(starts)]
    with_hidden = set(json.loads(meta.get("hidden_at", "[]")))
    checkpoints = {}
    for p in json.loads(meta.get("checkpoints", "[]")):
        if not 0 < p < n:
            raise ValueError(f"checkpoint {p} outside 1..{n - 1}")
        rec = tuple(None if is_attention(c) else recurrent(f"cp.{p}.{i}", c) for i, c in enumerate(template))
        checkpoints[p] = Checkpoint(p, rec, arrays[f"cp.{p}.hidden"] if p in with_hidden else None)
    return PrefixEntry(tokens, trunk, head, hidden if head is not None else None, checkpoints)


def prompt_store(lm, max_bytes: Optional[int] = None, folder: Optional[Path] = None,
                 disk_bytes: Optional[int] = None, notify: Optional[Callable[[str], None]] = None) -> PrefixCache:
    """The prompt cache for a loaded model: `max_bytes` of memory (None: the default share of what the
    model leaves of the device's, memory.py), and a disk tier in `folder` when given."""
    budget = default_budget(model_bytes(lm.model, lm.head)) if max_bytes is None else max_bytes
    disk = None
    if folder is not None:
        trunk_key, head_key = model_keys(lm)
        disk = DiskTier(folder, trunk_key, head_key, lm.model.make_cache, disk_bytes, notify)
    return PrefixCache(budget, disk)
