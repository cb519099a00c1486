"""`dyno head pull|list` and `dyno models`: managing MTP heads and seeing what is local."""

from pathlib import Path

from speculative.errors import DynoError

from ..paths import local_folders
from .common import notify


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
    models.add_argument("folders", nargs="*", metavar="MODEL",
                        help="model folders (or repo ids already in the Hugging Face cache) to include besides "
                             "the Hugging Face cache")
    models.set_defaults(func=cmd_models)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cmd_head_pull(args) -> int:
    from speculative.heads.store import planned_memory, pull_head
    from speculative.heads.precision import parse_head_bits

    parse_head_bits(args.mtp_head_bits)  # a bad value fails before anything is fetched
    target, base = pull_head(args.model, args.mtp_base, notify)
    memory = planned_memory(args.model, target, base, args.mtp_head_bits, notify)
    if base is None:
        print(f"{target} carries its own MTP head; nothing to fetch" + (f" (in memory {memory})" if memory else ""))
    else:
        print(f"MTP head of {base}: {target} ({_size(target) / 1e6:.1f} MB" + (f"; in memory {memory})" if memory else ")"))
    return 0


def cmd_head_list(args) -> int:
    from speculative.heads.store import json_object
    from speculative.heads.find import cached_heads_dir

    root = cached_heads_dir()
    rows = []
    for folder in sorted(root.glob("*")) if root.is_dir() else []:
        cfg_path = folder / "config.json"
        if folder.name.startswith(".") or not cfg_path.exists():
            continue  # a temp folder from an interrupted write is never listed, nor loaded
        cfg = json_object(cfg_path)
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


def _table(header, rows) -> None:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def _folder(model: str) -> Path:
    """The folder of a `dyno models` argument: a path, or a repo id's cached snapshot (listing never downloads)."""
    from speculative.loader.source import cached, is_repo_id

    if not is_repo_id(model):
        return Path(model).expanduser()
    found = cached(model)
    if found is None:
        raise DynoError(f"{model} is not in the local Hugging Face cache; `dyno generate --model {model}` "
                        f"downloads it")
    return found


def cmd_models(args) -> int:
    from speculative.heads.store import local_models

    rows = local_models(local_folders([_folder(f) for f in args.folders]), notify)
    if not rows:
        print("no Qwen3.5-family models found")
        return 0
    _table(("MODEL", "TYPE", "MTP HEAD"), rows)
    return 0
