"""Finding, extracting, fetching and caching MTP heads for models that lost theirs.

Resolution, first hit wins: --mtp-head DIR > the model's own mtp.* tensors > the Dyno cache >
the original checkpoint in the local Hugging Face cache (only the mtp.* tensors are read) > a
download of only the head's byte ranges from the original repository > none (a DynoError that
says what was tried).

The original is named by --mtp-base, else found (find_base) from the model card's base_model chain
(the card in the folder, else the card of the model's own repo: its Hugging Face cache path or the
name typed), config hints, and last the table of official releases matched by the config's shape.
"""

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import DynoError, one_line
from .mtp import HeadWeights, norm_probe, read_checkpoint_head, read_head_folder, write_head_folder
from .tensors import INDEX, check_table, checkpoint_files, decode, dequantize_fp8, read_index

PROMISE = "Set HF_HUB_OFFLINE=1 to prevent the download, or pass --mtp-head <folder>."
# A fine-tune that ships no head gets one by grafting its base model's and tuning it (measure/head_tune.py).
MAKE_ONE = ", or make one with `dyno head tune --mtp-head <base>`"
MAX_CHAIN = 6  # base_model hops before giving up (fine-tune -> quantized -> ... -> original)
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
RELEASE_TABLES = [Path(__file__).with_name("releases.json")]  # official releases by shape, with sources
Notify = Callable[[str], None]


def dyno_cache_dir() -> Path:
    """Dyno's own cache folder (heads, rankings, tuned depths; not the Hugging Face cache).

    DYNO_CACHE, else $XDG_CACHE_HOME/dyno, else ~/.cache/dyno.
    """
    if os.environ.get("DYNO_CACHE"):
        return Path(os.environ["DYNO_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "dyno"


def cached_heads_dir() -> Path:
    """Where Dyno keeps the heads it extracted or fetched."""
    return dyno_cache_dir() / "mtp"


def cached_head_path(repo_id: str) -> Path:
    """One head per base model: <cache>/mtp/<org>--<name>."""
    return cached_heads_dir() / repo_id.replace("/", "--")


def offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "")
    return constants.HF_HUB_OFFLINE or value.upper() in ("1", "ON", "YES", "TRUE")


def card_base_models(readme: Path) -> List[str]:
    """The `base_model` entries of a model card's metadata (a string or a list)."""
    from huggingface_hub.repocard import metadata_load

    try:
        meta = metadata_load(readme) or {}
    except Exception:  # a malformed card is no base model, not a crash
        return []
    base = meta.get("base_model") or []
    return [b for b in ([base] if isinstance(base, str) else base) if isinstance(b, str) and _REPO_ID.match(b)]


def config_hints(config: dict) -> List[str]:
    """Repo ids some converters leave in config.json."""
    hints = [config.get(k) for k in ("base_model", "_name_or_path")]
    return [h for h in hints if isinstance(h, str) and _REPO_ID.match(h)]


def _mtp_names(weight_map: Dict[str, str]) -> Dict[str, str]:
    from .mtp import CHECKPOINT_PREFIXES

    return {k: v for k, v in weight_map.items() if k.startswith(CHECKPOINT_PREFIXES)}


class Hub:
    """The few Hub operations Dyno needs, through huggingface_hub (endpoint, token, cache, UA)."""

    def __init__(self, notify: Notify):
        self.notify = notify
        self.unreachable: List[str] = []  # repos we could not look into (offline, not cached)

    def cached(self, repo: str, filename: str) -> Optional[Path]:
        """A file of `repo` already in the local Hugging Face cache."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, filename)
        return Path(found) if isinstance(found, str) else None

    def file(self, repo: str, filename: str, revision: Optional[str] = None) -> Optional[Path]:
        """A small file (card, index), from the cache or downloaded; None if the repo lacks it."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)

        if offline():
            found = self.cached(repo, filename)
            if found is None and repo not in self.unreachable:
                self.unreachable.append(repo)
            return found
        try:
            return Path(hf_hub_download(repo, filename, revision=revision))
        except LocalEntryNotFoundError:  # the Hub could not be reached (a subclass of "no such file")
            if repo not in self.unreachable:
                self.unreachable.append(repo)
            return None
        except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
            return None
        except Exception as e:
            raise DynoError(f"cannot reach the Hub for {repo}/{filename}: {one_line(e)}") from None

    def weight_map(self, repo: str, revision: Optional[str] = None) -> Optional[Dict[str, str]]:
        """Tensor name -> shard for `repo`, from its index (None when it has no index)."""
        path = self.file(repo, INDEX, revision)
        return None if path is None else read_index(path)

    def ships_head(self, repo: str) -> bool:
        wm = self.weight_map(repo)
        return bool(wm and _mtp_names(wm))


@dataclass
class Trail:
    """What find_base looked at, in order, for the notice when it finds no head; `by_shape` names the
    release the shape table picked (no card or hint named it), so the caller can say it was a match."""

    label: str  # the model as the user knows it: its repo id, else its folder's name
    steps: List[str] = field(default_factory=list)
    by_shape: Optional[str] = None
    candidates_here: bool = False  # shape-table candidates whose heads are here: --mtp-base works offline

    def not_found(self) -> DynoError:
        """No head anywhere: what was tried, and the one flag that fixes it."""
        fix = ("--mtp-base ORG/NAME (the original checkpoint)" if self.candidates_here or not offline()
               else "--mtp-head <folder>")
        return DynoError(f"no MTP head for {self.label}: it has no mtp.* tensors; {'; '.join(self.steps)}; "
                         f"pass {fix}{MAKE_ONE}")


def snapshot_repo(folder: Path) -> Optional[str]:
    """The repo id of a Hugging Face cache snapshot (.../models--ORG--NAME/snapshots/<rev>), else None."""
    for path in (folder, folder.resolve()):
        cache_name = path.parent.parent.name
        if path.parent.name == "snapshots" and cache_name.startswith("models--"):
            repo = cache_name[len("models--"):].replace("--", "/")  # huggingface_hub's own folder naming
            return repo if _REPO_ID.match(repo) else None
    return None


def own_repo(model_folder: Path, repo_id: Optional[str] = None) -> Optional[str]:
    """The model's own repo id: from its Hugging Face cache path, else the name it was loaded by."""
    return snapshot_repo(model_folder) or (repo_id if repo_id and _REPO_ID.match(repo_id) else None)


def releases() -> List[dict]:
    """The official releases with an MTP head: repo, the config figures that identify it, sources."""
    table = []
    for path in RELEASE_TABLES:
        table += json.loads(Path(path).read_text())["releases"]
    return table


def shape_matches(config: dict) -> List[str]:
    """The releases whose every listed figure agrees with this config (table order)."""
    text = config.get("text_config", config)
    have = dict(text, moe=bool(text.get("num_experts")))
    return [r["repo"] for r in releases() if all(have.get(k) == v for k, v in r["shape"].items())]


def _head_here(repo: str, hub: Hub) -> bool:
    """Whether the head of `repo` is on this machine (Dyno cache or HF cache), without the network."""
    try:
        return cached_head_path(repo).exists() or hf_cache_has_head(repo, hub)
    except DynoError:  # a broken cached index: not a head to pick by shape
        return False


def _by_shape(config: dict, hub: Hub, trail: Trail) -> Optional[str]:
    """The last resort: the official release of this shape. One match is taken (fetched when
    online). Several (Qwen3.5-, 3.6- and 3.8-27B share a shape, not their weights) are taken only
    when exactly one of them has its head on this machine: that the user fetched it is the only
    evidence there is. A wrong head would cost acceptance, never exactness, but downloading 0.85 GB
    on a guess is not honest: the notice names the candidates instead."""
    candidates = shape_matches(config)
    here = [c for c in candidates if _head_here(c, hub)]
    if len(here) == 1:
        trail.by_shape = here[0]
        return here[0]
    if len(candidates) == 1 and not here and not offline() and hub.ships_head(candidates[0]):
        trail.by_shape = candidates[0]
        return candidates[0]
    trail.candidates_here = bool(here)
    if not candidates:
        why = "no match"
    elif here:
        why = f"{', '.join(candidates)} match, {len(here)} with a head here"
    elif len(candidates) > 1:
        why = f"{', '.join(candidates)} match, none with a head here"
    else:
        why = f"{candidates[0]} matches, " + ("its head is not here" if offline() else "its index has no mtp.* tensors")
    trail.steps.append(f"shape table: {why}")
    return None


def _own_card(model_folder: Path, own: Optional[str], hub: Hub, trail: Trail) -> List[str]:
    """The base_model entries of the model's card: its README.md, else its repo's card (a few KB,
    fetched when online): mlx-lm downloads no README.md, and mlx_lm.convert drops _name_or_path."""
    readme = model_folder / "README.md"
    if readme.exists():
        where, card = "card (README.md)", readme
    elif own:
        where = f"card of {own}"
        try:  # offline: the cached card only, and a repo not looked into is not a base that was missed
            card = hub.cached(own, "README.md") if offline() else hub.file(own, "README.md")
        except DynoError as e:  # the network failing costs this step, not the shape table after it
            trail.steps.append(f"{where}: {e.message}")
            return []
    else:
        trail.steps.append("card: none (no README.md, no repo id)")
        return []
    bases = card_base_models(card) if card is not None else []
    state = ("base_model " + ", ".join(bases) if bases else "no base_model" if card is not None
             else "not in the Hugging Face cache (offline)" if offline() else "none")
    trail.steps.append(f"{where}: {state}")
    return bases


def find_base(model_folder: Path, config: dict, hub: Hub, mtp_base: Optional[str] = None,
              repo_id: Optional[str] = None, trail: Optional[Trail] = None) -> Optional[str]:
    """The repository whose index ships mtp.* tensors for this model: --mtp-base, else the model
    card's base_model chain (fine-tunes, abliterated and quantized versions), else config hints,
    else the table of official releases matched by the config's shape. `repo_id` is the name the
    model was loaded by (a snapshot's own path says it too); `trail` collects what was tried."""
    if mtp_base:
        return mtp_base
    own = own_repo(model_folder, repo_id)
    trail = trail if trail is not None else Trail(own or model_folder.name)
    hints = config_hints(config)
    frontier = _own_card(model_folder, own, hub, trail) + hints
    trail.steps.append(f"config hints: {', '.join(hints) or 'none'}")
    seen: List[str] = []
    for _ in range(MAX_CHAIN):
        next_frontier = []
        for repo in frontier:
            if repo in seen:
                continue
            seen.append(repo)
            if cached_head_path(repo).exists() or hub.ships_head(repo):
                return repo
            card = hub.file(repo, "README.md")
            if card is not None:
                next_frontier += card_base_models(card)
        if not next_frontier:
            break
        frontier = next_frontier
    trail.steps.append(f"base_model chain: {', '.join(seen) + ': no mtp.* tensors' if seen else 'none'}")
    return _by_shape(config, hub, trail)


def extract_from_hf_cache(repo: str, hub: Hub) -> Optional[HeadWeights]:
    """The head of a full checkpoint already in the local HF cache, reading only mtp.* tensors;
    None when the cache lacks a file it needs (the caller downloads the head instead)."""
    index = hub.cached(repo, INDEX)
    if index is None:
        return None
    try:
        weight_map = read_index(index)
        shards = set(_mtp_names(weight_map).values())
        probe = norm_probe(weight_map)  # the conv1d shard decides the norm shift: it must be here too
        needed = shards | ({probe[1]} if probe else set())
        if not shards or any(hub.cached(repo, s) is None for s in needed):
            return None
        head = read_checkpoint_head(index.parent)
    except DynoError as e:
        raise DynoError(f"{e.message}; delete that file from the Hugging Face cache of {repo} to "
                        f"download the head instead") from None
    if head is not None:
        head.source = f"{repo} (local Hugging Face cache)"
        head.provenance["source"] = {"repo": repo, "revision": index.parent.name, "via": "hf-cache"}
    return head


def checkpoint_has_head(folder: Path) -> bool:
    """Whether a checkpoint holds mtp.* tensors, by its index or headers only (no tensor is read)."""
    from .mtp import CHECKPOINT_PREFIXES

    return any(name.startswith(CHECKPOINT_PREFIXES) for name in checkpoint_files(folder))


def hf_cache_has_head(repo: str, hub: Hub) -> bool:
    """Whether the local HF cache holds every file extract_from_hf_cache would read for `repo`."""
    index = hub.cached(repo, INDEX)
    if index is None:
        return False
    weight_map = read_index(index)
    probe = norm_probe(weight_map)
    needed = set(_mtp_names(weight_map).values()) | ({probe[1]} if probe else set())
    return bool(_mtp_names(weight_map)) and all(hub.cached(repo, s) is not None for s in needed)


def _ranges(entries: List[Tuple[str, int, int]]) -> List[Tuple[int, int, List[Tuple[str, int, int]]]]:
    """Merge byte ranges [start, end) that touch, so contiguous tensors come in one request."""
    merged = []
    for name, start, end in sorted(entries, key=lambda e: e[1]):
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
            merged[-1][2].append((name, start, end))
        else:
            merged.append([start, end, [(name, start, end)]])
    return [tuple(m) for m in merged]


def download_head(repo: str, hub: Hub, revision: Optional[str] = None) -> HeadWeights:
    """Fetch only the head's tensors from `repo`: index, shard headers, then their byte ranges."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session
    from huggingface_hub.utils import tqdm as hf_tqdm

    try:
        meta = get_hf_file_metadata(hf_hub_url(repo, INDEX, revision=revision))
        commit = meta.commit_hash or revision
    except Exception as e:
        raise DynoError(f"cannot reach the Hub for {repo}: {one_line(e)}") from None
    weight_map = hub.weight_map(repo, commit) or {}
    names = _mtp_names(weight_map)
    if not names:
        raise DynoError(f"{repo} has no mtp.* tensors in its {INDEX}")
    headers = build_hf_headers()
    session = get_session()
    plan, tables = {}, {}
    for shard in sorted(set(names.values())):
        url = hf_hub_url(repo, shard, revision=commit)
        base, table = tables[shard] = _remote_header(session, url, headers)
        absent = [n for n in names if names[n] == shard and n not in table]
        if absent:
            raise DynoError(f"{url} has no tensor {absent[0]}, which the {INDEX} of {repo} places there")
        plan[shard] = (url, base, {n: table[n] for n in names if names[n] == shard})
    total = sum(e["data_offsets"][1] - e["data_offsets"][0] for _, _, t in plan.values() for e in t.values())
    hub.notify(f"dyno: fetching the MTP head of {repo} ({total / 1e9:.2f} GB). {PROMISE}")
    tensors, hashes = {}, {}
    with hf_tqdm(total=total, unit="B", unit_scale=True, desc=f"MTP head {repo}") as bar:
        for shard, (url, base, table) in plan.items():
            entries = [(n, e["data_offsets"][0], e["data_offsets"][1]) for n, e in table.items()]
            for start, end, parts in _ranges(entries):
                raw = _get_range(session, url, headers, base + start, base + end, bar)
                for name, s, e in parts:
                    chunk = raw[s - start : e - start]
                    tensors[name] = _checked(_decode(chunk, table[name], name, url), name, repo)
                    hashes[name] = hashlib.sha256(chunk).hexdigest()
    raw, quantization = _remote_convention(repo, commit, weight_map, tables, hub, session, headers)
    weights = HeadWeights(
        dequantize_fp8({k[len(_prefix(k)):]: v for k, v in tensors.items()}), norms_shifted=False if raw else None,
        source=f"{repo}@{commit}" if commit else repo,
        provenance={"source": {"repo": repo, "revision": commit, "via": "download",
                               "files": sorted(plan), "sha256": hashes, "bytes": total}, "raw_hf": raw},
        quantization=quantization,
    )
    return weights


def _remote_convention(repo: str, commit, weight_map: dict, tables: dict, hub: Hub, session,
                       headers: dict) -> Tuple[bool, Optional[dict]]:
    """(raw HF checkpoint, the quantization its tensors were packed with) of a remote repo, by
    provenance as for a local one: the conv1d weight's shape in its shard's header (one more
    header when another shard holds it), and config.json's `quantization` for an MLX conversion."""
    from huggingface_hub import hf_hub_url

    probe = norm_probe(weight_map)
    if probe is None:
        return False, None
    name, shard = probe
    if shard not in tables:
        tables[shard] = _remote_header(session, hf_hub_url(repo, shard, revision=commit), headers)
    entry = tables[shard][1].get(name)
    if entry is None:
        raise DynoError(f"{shard} of {repo} has no tensor {name}, which its {INDEX} places there")
    if entry["shape"][-1] != 1:
        return True, None
    config_path = hub.file(repo, "config.json", commit)
    try:
        quantization = json.loads(config_path.read_text()).get("quantization") if config_path else None
    except (OSError, ValueError, AttributeError):
        quantization = None
    return False, quantization if isinstance(quantization, dict) else None


def _prefix(name: str) -> str:
    from .mtp import CHECKPOINT_PREFIXES

    return next(p for p in CHECKPOINT_PREFIXES if name.startswith(p))


def _decode(chunk: bytes, entry: dict, name: str, url: str):
    try:
        return decode(chunk, entry["dtype"], entry["shape"])
    except DynoError as e:
        raise DynoError(f"cannot read {name} from {url}: {e.message}") from None


def _checked(arr, name: str, repo: str):
    """A float tensor with NaN or inf is a corrupt range, not a head."""
    import mlx.core as mx

    if mx.issubdtype(arr.dtype, mx.floating) and not mx.all(mx.isfinite(arr)).item():
        raise DynoError(f"corrupt data for {name} from {repo}: non-finite values; run again to retry")
    return arr


def _remote_header(session, url: str, headers: dict) -> Tuple[int, dict]:
    """(data start offset, tensor table) of a remote safetensors file, by two range requests."""
    import struct

    (n,) = struct.unpack("<Q", _get_range(session, url, headers, 0, 8))
    try:
        table = json.loads(_get_range(session, url, headers, 8, 8 + n))
    except ValueError:
        raise DynoError(f"corrupt safetensors header in {url}; run again to retry") from None
    return 8 + n, check_table(table, url)


def _get_range(session, url: str, headers: dict, start: int, end: int, bar=None) -> bytes:
    """Bytes [start, end) of `url`; the reply must be exactly that range."""
    want = f"bytes {start}-{end - 1}/"
    try:
        with session.stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end - 1}"},
                            follow_redirects=True) as r:
            if r.status_code != 206 or not r.headers.get("Content-Range", "").startswith(want):
                raise DynoError(f"bad range reply from {url}: status {r.status_code}, "
                                f"Content-Range {r.headers.get('Content-Range')!r}, wanted {want}...")
            buf = bytearray()
            for chunk in r.iter_bytes():
                buf += chunk
                if bar is not None:
                    bar.update(len(chunk))
    except DynoError:
        raise
    except Exception as e:
        raise DynoError(f"download from {url} was interrupted ({one_line(e)}); run again to retry") from None
    if len(buf) != end - start:
        raise DynoError(f"download from {url} was cut short ({len(buf)} of {end - start} bytes); run again to retry")
    return bytes(buf)


def _offline_error(label: str, repos: List[str]) -> DynoError:
    why = ("HF_HUB_OFFLINE=1 prevents downloading it" if offline()
           else "the Hugging Face Hub could not be reached to download it")
    return DynoError(
        f"no MTP head for {label}: looked for {', '.join(repos)} in {cached_heads_dir()} and in "
        f"the Hugging Face cache; {why}. Pass --mtp-head <folder>{MAKE_ONE}."
    )


def read_cached_head(folder: Path) -> HeadWeights:
    """A head from the Dyno cache; a broken one names the folder to delete (it is fetched again)."""
    try:
        return read_head_folder(folder)
    except DynoError as e:
        raise DynoError(f"{e.message}; delete {folder} to fetch the head again") from None


def resolve_head(model_folder: Path, config: dict, notify: Notify, mtp_head: Optional[str] = None,
                 mtp_base: Optional[str] = None, repo_id: Optional[str] = None, own: bool = True) -> HeadWeights:
    """The head for a model; caches what it extracts or downloads. `repo_id` is the name the model
    was loaded by (mlx-community/...), whose card names the original; own=False skips the model's
    own mtp.* tensors (the loader tried them and they could not be used). No head: a DynoError that
    says what was tried."""
    if mtp_head and not _is_repo_id(mtp_head):
        return read_head_folder(Path(mtp_head).expanduser())
    if mtp_base and not _is_repo_id(mtp_base):  # a folder on disk, not a repo id: read it where it is
        return read_local_base(Path(mtp_base).expanduser())
    mtp_base = mtp_head or mtp_base  # a repo id either way: the head in its index, cached once
    own_head = read_checkpoint_head(model_folder) if own else None
    if own_head is not None:
        return own_head
    hub = Hub(notify)
    trail = Trail(own_repo(model_folder, repo_id) or model_folder.name)
    base = find_base(model_folder, config, hub, mtp_base, repo_id, trail)
    if base is None and hub.unreachable:
        raise _offline_error(trail.label, hub.unreachable)
    if base is None:
        raise trail.not_found()
    if trail.by_shape:
        notify(f"dyno: no card or config names the original of {trail.label}; its shape is that of {base} "
               f"(shape table), whose head it takes; pass --mtp-base ORG/NAME to choose another")
    cached = cached_head_path(base)
    if cached.exists():
        return read_cached_head(cached)
    cache_head(base, hub, lambda: config.get("text_config", config), lambda: _offline_error(trail.label, [base]))
    return read_head_folder(cached)


def _is_repo_id(spec: str) -> bool:
    """ORG/NAME that is no existing path and does not look like one (loader.source.is_repo_id's rule)."""
    text = str(spec)
    return not text.startswith((".", "/", "~")) and bool(_REPO_ID.match(text)) and not Path(text).exists()


def read_local_base(folder: Path) -> HeadWeights:
    """`--mtp-base FOLDER`: the head of a checkpoint (or head folder) on disk, read in place."""
    if not folder.is_dir():
        raise DynoError(f"--mtp-base {folder}: no such folder, and not a repo id (ORG/NAME)")
    if any(folder.glob("*.safetensors")) and not checkpoint_has_head(folder) and "fc.weight" not in checkpoint_files(folder):
        raise DynoError(f"--mtp-base {folder} has no MTP head: its checkpoint holds no mtp.* tensors")
    return read_head_folder(folder)


def cache_head(base: str, hub: Hub, text_config: Callable[[], dict],
               offline_error: Callable[[], DynoError]) -> Path:
    """The cached head folder of `base`, extracted from the Hugging Face cache or downloaded first
    when it is not there yet (`offline_error` when HF_HUB_OFFLINE forbids the download)."""
    target = cached_head_path(base)
    if not target.exists():
        head = extract_from_hf_cache(base, hub)
        if head is None:
            if offline():
                raise offline_error()
            head = download_head(base, hub)
        write_head_folder(target, head, text_config(), extra={"base_model": base})
    return target
