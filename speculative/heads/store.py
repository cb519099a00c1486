"""Heads ahead of time and what is on disk: pulling a head into the cache, the memory it will take,
and which local models have one. Listing reads file names and headers, never a tensor."""

import json
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple

from . import find
from ..errors import DynoError

Notify = Callable[[str], None]
_FLOATS = {"BF16": (2, "bfloat16"), "F16": (2, "float16"), "F32": (4, "float32")}  # itemsize, name


def json_object(path: Path) -> Optional[dict]:
    """The JSON object in `path`, or None when it is unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def pull_head(model: str, mtp_base: Optional[str], notify: Notify) -> Tuple[Path, Optional[str]]:
    """Fetch and cache the head for `model` (a folder or repo id): (head folder, base repo), or (folder, None)
    when the checkpoint carries its own head."""
    hub = find.Hub(notify)
    folder = Path(model).expanduser()
    if folder.is_dir():
        config = json_object(folder / "config.json") or {}
        if find.read_checkpoint_head(folder) is not None:
            return folder, None
        base = find.find_base(folder, config, hub, mtp_base)
    elif find._REPO_ID.match(model):
        base = mtp_base or (model if hub.ships_head(model) else None)
        if base is None:
            card = hub.file(model, "README.md")
            base = find.find_base(card.parent, {}, hub) if card else None
    else:
        raise DynoError(f"not a model folder or a repo id: {model}")
    if base is None:
        raise DynoError(f"no base model with an MTP head found for {model}; pass --mtp-base REPO")

    def text_config() -> dict:
        path = hub.file(base, "config.json")
        config = json.loads(path.read_text()) if path else {}
        return config.get("text_config", config)

    def offline_error() -> DynoError:
        return DynoError(f"the head of {base} is not cached and HF_HUB_OFFLINE=1 prevents downloading it")

    return find.cache_head(base, hub, text_config, offline_error), base


def planned_memory(model: str, target: Path, base: Optional[str], bits=None, notify: Notify = lambda m: None) -> str:
    """`0.45 GB at 8-bit`: what the pulled head will take once loaded at `bits` (default:
    follow the model's trunk), by arithmetic on its config and stored dtype; "" when unknown."""
    from . import precision  # imports MLX: only when a size is asked for
    from .tensors import checkpoint_files, read_header

    folder = Path(model).expanduser()
    if folder.is_dir():
        model_config = json_object(folder / "config.json") or {}
    else:
        found = find.Hub(notify).file(model, "config.json")
        model_config = (json_object(found) or {}) if found else {}
    text = model_config.get("text_config", model_config)
    if base is None:
        files = {n: f for n, f in checkpoint_files(target).items() if n.endswith("mtp.fc.weight")}
    else:
        text = (json_object(target / "config.json") or {}).get("text_config") or text
        files = {"mtp.fc.weight": target / "mtp.safetensors"}
    try:
        (name, path), = files.items()
        itemsize, dtype = _FLOATS[read_header(path)[name]["dtype"]]  # a head stored quantized: not planned here
        chosen = precision.head_bits(bits, model_config.get("quantization"))
        n = precision.planned_bytes(text, chosen, itemsize)
    except (DynoError, KeyError, ValueError, TypeError):
        return ""
    label = f"{chosen}-bit" if chosen != 16 else dtype
    return f"{precision.format_bytes(n)} at {label}"


def head_status(folder: Path, config: dict, hub: find.Hub) -> str:
    """in checkpoint / cached / fetchable / none, from file names and headers only: no tensor is
    read, so listing a cache of large models is quick."""
    if find.checkpoint_has_head(folder):
        return "in checkpoint"
    try:
        base = find.find_base(folder, config, hub)
    except DynoError:
        base = None
    if base is None:
        return "none"
    if find.cached_head_path(base).exists():
        return "cached"
    return "fetchable" if not find.offline() or find.hf_cache_has_head(base, hub) else f"none (offline; base {base})"


def local_models(folders: Iterable[Path], notify: Notify) -> List[Tuple[str, str, str]]:
    """(model, model_type, head status) of the Qwen3.5-family models among `folders`; a model is named as
    `--model` takes it: the repo id for the Hugging Face cache's current snapshot, else its folder."""
    hub = find.Hub(notify)
    rows = []
    for folder in folders:
        config = json_object(folder / "config.json")
        model_type = config.get("model_type") if config else None
        if not isinstance(model_type, str) or not model_type.startswith("qwen3_5"):
            continue  # not a model folder, an unreadable config, or another family
        try:
            status = head_status(folder, config, hub)
        except DynoError as e:  # one broken folder is reported in its row, never the whole listing
            status = f"unknown ({e.message})"
        rows.append((model_label(folder), model_type, status))
    return rows


def model_label(folder: Path) -> str:
    """How a listing shows a local model: the repo id for the snapshot `--model ORG/NAME` loads, else the path."""
    repo, folder = find.snapshot_repo(Path(folder)), Path(folder)
    try:
        current = repo is not None and (folder.parent.parent / "refs" / "main").read_text().strip() == folder.name
    except OSError:
        current = False
    return repo if current else str(folder)
