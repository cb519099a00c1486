"""`dyno head pull|list` and `dyno models`: managing MTP heads and seeing what is local."""

import json
import sys
from pathlib import Path

from speculative.errors import DynoError

from .models import local_folders


def add_commands(sub) -> None:
    """Register `head` and `models` on the top-level subparsers."""
    head = sub.add_parser("head", help="fetch and list cached MTP heads")
    hsub = head.add_subparsers(dest="head_command", metavar="ACTION")
    pull = hsub.add_parser("pull", help="fetch and cache the MTP head for a model ahead of time")
    pull.add_argument("model", help="a local model folder or a Hugging Face repo id")
    pull.add_argument("--mtp-base", metavar="REPO", help="take the head from this repository")
    pull.add_argument("--mtp-head-bits", metavar="{16,8,4}",
                      help="report the memory the head takes at this precision (the cache keeps it as "
                           "downloaded, bf16); default: follow the model's trunk")
    pull.set_defaults(func=cmd_head_pull)
    lst = hsub.add_parser("list", help="show cached heads with their size and source")
    lst.set_defaults(func=cmd_head_list)
    head.set_defaults(func=lambda args: (head.print_help(), 2)[1])
    models = sub.add_parser("models", help="list local models and their MTP head status")
    models.add_argument("folders", nargs="*", help="model folders to include besides the Hugging Face cache")
    models.set_defaults(func=cmd_models)


def _notify(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cmd_head_pull(args) -> int:
    from speculative.precision import parse_head_bits

    parse_head_bits(args.mtp_head_bits)  # a bad value fails before anything is fetched
    target, base = pull_head(args.model, args.mtp_base, _notify)
    memory = planned_memory(args.model, target, base, args.mtp_head_bits)
    if base is None:
        print(f"{target} carries its own MTP head; nothing to fetch" + (f" (in memory {memory})" if memory else ""))
    else:
        print(f"MTP head of {base}: {target} ({_size(target) / 1e6:.1f} MB" + (f"; in memory {memory})" if memory else ")"))
    return 0


_FLOATS = {"BF16": (2, "bfloat16"), "F16": (2, "float16"), "F32": (4, "float32")}  # itemsize, name


def planned_memory(model: str, target: Path, base, bits=None) -> str:
    """`0.45 GB at 8-bit`: what the pulled head will take once loaded at `bits` (default:
    follow the model's trunk), by arithmetic on its config and stored dtype; "" when unknown."""
    from speculative import heads, precision
    from speculative.tensors import checkpoint_files, read_header

    folder = Path(model).expanduser()
    if folder.is_dir():
        model_config = _json_object(folder / "config.json") or {}
    else:
        found = heads.Hub(_notify).file(model, "config.json")
        model_config = (_json_object(found) or {}) if found else {}
    text = model_config.get("text_config", model_config)
    if base is None:
        files = {n: f for n, f in checkpoint_files(target).items() if n.endswith("mtp.fc.weight")}
    else:
        text = (_json_object(target / "config.json") or {}).get("text_config") or text
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


def pull_head(model: str, mtp_base=None, notify=_notify):
    """Fetch and cache the head for `model` (a folder or repo id): (head folder, base repo), or (folder, None)
    when the checkpoint carries its own head."""
    from speculative import heads

    hub = heads.Hub(notify)
    folder = Path(model).expanduser()
    if folder.is_dir():
        config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
        if heads.read_checkpoint_head(folder) is not None:
            return folder, None
        base = heads.find_base(folder, config, hub, mtp_base)
    elif heads._REPO_ID.match(model):
        base = mtp_base or (model if hub.ships_head(model) else None)
        if base is None:
            card = hub.file(model, "README.md")
            base = heads.find_base(card.parent, {}, hub) if card else None
    else:
        raise DynoError(f"not a model folder or a repo id: {model}")
    if base is None:
        raise DynoError(f"no base model with an MTP head found for {model}; pass --mtp-base REPO")
    target = heads.cached_head_path(base)
    if not target.exists():
        head = heads.extract_from_hf_cache(base, hub)
        if head is None:
            if heads.offline():
                raise DynoError(f"the head of {base} is not cached and HF_HUB_OFFLINE=1 prevents downloading it")
            head = heads.download_head(base, hub)
        text_config = _base_text_config(hub, base)
        heads.write_head_folder(target, head, text_config, extra={"base_model": base})
    return target, base


def _base_text_config(hub, repo: str) -> dict:
    path = hub.file(repo, "config.json")
    config = json.loads(path.read_text()) if path else {}
    return config.get("text_config", config)


def cmd_head_list(args) -> int:
    from speculative.heads import head_cache_dir

    root = head_cache_dir()
    rows = []
    for folder in sorted(root.glob("*")) if root.is_dir() else []:
        cfg_path = folder / "config.json"
        if folder.name.startswith(".") or not cfg_path.exists():
            continue  # a temp folder from an interrupted write is never listed, nor loaded
        cfg = _json_object(cfg_path)
        if cfg is None:  # broken: listed with the fix that loading it would also name
            rows.append((folder.name.replace("--", "/"), f"{_size(folder) / 1e6:.1f} MB", "unreadable",
                         f"delete {folder} to fetch it again"))
            continue
        src = cfg["source"] if isinstance(cfg.get("source"), dict) else {}
        origin = src.get("repo") or src.get("from", "?")
        rev = (src.get("revision") or "")[:12]
        rows.append((cfg.get("base_model", folder.name.replace("--", "/")), f"{_size(folder) / 1e6:.1f} MB",
                     "moe (bf16 experts)" if cfg.get("architecture") == "moe" else cfg.get("architecture", "?"),
                     f"{origin}@{rev} via {src.get('via', '?')}" if rev else origin))
    if not rows:
        print(f"no cached MTP heads in {root}")
        return 0
    _table(("BASE MODEL", "SIZE", "KIND", "SOURCE"), rows)
    print(f"({root})")
    return 0


def _json_object(path: Path):
    """The JSON object in `path`, or None when it is unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _table(header, rows) -> None:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def head_status(folder: Path, config: dict, hub) -> str:
    """in checkpoint / cached / fetchable / none, from file names and headers only: no tensor is
    read, so listing a cache of large models is quick and needs no MLX."""
    from speculative import heads

    if heads.checkpoint_has_head(folder):
        return "in checkpoint"
    try:
        base = heads.find_base(folder, config, hub)
    except DynoError:
        base = None
    if base is None:
        return "none"
    if heads.cached_head_path(base).exists():
        return "cached"
    return "fetchable" if not heads.offline() or heads.hf_cache_has_head(base, hub) else f"none (offline; base {base})"


def cmd_models(args) -> int:
    rows = local_models([Path(f).expanduser() for f in args.folders])
    if not rows:
        print("no Qwen3.5-family models found")
        return 0
    _table(("MODEL", "TYPE", "MTP HEAD"), rows)
    return 0


def local_models(extra_folders=(), notify=_notify):
    """(folder, model_type, head status) of the bundled model, `extra_folders` and the Hugging Face cache."""
    from speculative import heads

    folders = local_folders(extra_folders)
    hub = heads.Hub(notify)
    rows = []
    for folder in folders:
        config = _json_object(folder / "config.json")
        model_type = config.get("model_type") if config else None
        if not isinstance(model_type, str) or not model_type.startswith("qwen3_5"):
            continue  # not a model folder, an unreadable config, or another family
        try:
            status = head_status(folder, config, hub)
        except DynoError as e:  # one broken folder is reported in its row, never the whole listing
            status = f"unknown ({e.message})"
        rows.append((str(folder), model_type, status))
    return rows
