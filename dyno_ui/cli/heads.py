"""`dyno head pull|list|tune|eval` and `dyno models`: managing MTP heads, tuning and measuring them, and seeing
what is local."""

import sys
from pathlib import Path

from speculative.errors import DynoError

from ..paths import local_folders
from .common import MODEL_HELP, notify


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
    _add_tune(hsub)
    _add_eval(hsub)
    head.set_defaults(func=lambda args: (head.print_help(), 2)[1])
    models = sub.add_parser("models", help="list local models and their MTP head status")
    models.add_argument("folders", nargs="*", metavar="MODEL",
                        help="model folders (or repo ids already in the Hugging Face cache) to include besides "
                             "the Hugging Face cache")
    models.set_defaults(func=cmd_models)


def _add_head_source(p) -> None:
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--mtp-head", metavar="DIR",
                   help="the head to start from: a head folder, a checkpoint with its head embedded, or a repo id "
                        "(default: the model's own, found as `dyno generate` finds it)")
    p.add_argument("--mtp-base", metavar="REPO", help="the original repository (or checkpoint folder) to take it from")


def _add_eval(hsub) -> None:
    ev = hsub.add_parser("eval", help="acceptance of a head by position on held-out text",
                         description="Continue prompts from held-out text with drafting at each depth, greedy and "
                                     "sampled, and print acceptance by position and tokens per round.")
    _add_head_source(ev)
    ev.add_argument("--data", required=True, metavar="FILE",
                    help="held-out text: a text file, or JSONL with text, prompt or messages per line")
    ev.add_argument("--depths", default="1,2,3,4", metavar="K[,K]", help="draft depths (default: %(default)s)")
    ev.add_argument("--temp", type=float, default=0.7, metavar="T",
                    help="the temperature measured besides greedy; 0: greedy only (default: %(default)s)")
    ev.add_argument("--prompts", type=int, default=8, metavar="N", help="prompts (default: %(default)s)")
    ev.add_argument("--prompt-tokens", type=int, default=64, metavar="N",
                    help="tokens of each prompt cut from a document (default: %(default)s)")
    ev.add_argument("--max-tokens", type=int, default=128, metavar="N",
                    help="tokens the model writes after each prompt (default: %(default)s)")
    ev.add_argument("--seed", type=int, default=0, metavar="S", help="sampled runs' seed (default: %(default)s)")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=cmd_head_eval)


def _add_tune(hsub) -> None:
    from speculative.measure.head_tune import TuneSettings as T

    tu = hsub.add_parser("tune", help="distil a head to the model it drafts for (the trunk frozen)",
                         description="Train the MTP head alone on the model's own next-token distributions; "
                                     "write a head folder --mtp-head loads (docs/heads.md, Tuning a head).")
    _add_head_source(tu)
    tu.add_argument("--data", required=True, metavar="FILE",
                    help="text to tune on: a text file, or JSONL with text (documents), prompt or messages "
                         "(continued by the model first) per line")
    tu.add_argument("--out", required=True, metavar="DIR",
                    help="the head folder to write, at the end in one rename; until then the checkpoint "
                         ".DIR.tune beside it is the resume point: after Ctrl-C or a failure (the evaluation "
                         "or the write after the last step included) the same command goes on from it; "
                         "removed once the head is written")
    tu.add_argument("--overwrite", action="store_true",
                    help="replace --out when it exists (the old folder is removed only once the new one is in place)")
    tu.add_argument("--eval-data", metavar="FILE",
                    help="held-out text for the card's acceptance before and after (default: --data's held-out part)")
    tu.add_argument("--steps", type=int, default=T.steps, metavar="N", help="optimizer steps (default: %(default)s)")
    tu.add_argument("--seq-len", type=int, default=T.seq_len, metavar="N", help="tokens per window (default: %(default)s)")
    tu.add_argument("--batch", type=int, default=T.batch, metavar="N",
                    help="windows per step; 0: sized to memory (default: %(default)s)")
    tu.add_argument("--lr", type=float, default=T.lr, help="AdamW learning rate (default: %(default)s)")
    tu.add_argument("--depth", type=int, default=T.depth, metavar="K",
                    help="steps the head is unrolled on its own outputs (default: %(default)s)")
    tu.add_argument("--top-k", type=int, default=T.top_k, metavar="K",
                    help="trunk tokens kept in the KL target (default: %(default)s)")
    tu.add_argument("--continue-tokens", type=int, default=T.continue_tokens, metavar="N",
                    help="tokens the model writes after each prompt of --data (default: %(default)s)")
    tu.add_argument("--continue-temp", type=float, default=T.continue_temperature, metavar="T",
                    help="temperature of those continuations; 0: greedy (default: %(default)s)")
    tu.add_argument("--eval-prompts", type=int, default=8, metavar="N",
                    help="held-out prompts for the card's figures (default: %(default)s)")
    tu.add_argument("--seed", type=int, default=T.seed, metavar="S", help="(default: %(default)s)")
    tu.set_defaults(func=cmd_head_tune)


def _depths(text: str):
    from speculative.config import MAX_DRAFT_DEPTH

    try:
        depths = [int(d) for d in text.split(",")]
    except ValueError:
        depths = []
    if not depths or not all(1 <= d <= MAX_DRAFT_DEPTH for d in depths):
        raise DynoError(f"--depths must be depths from 1 to {MAX_DRAFT_DEPTH} separated by commas, got {text!r}")
    return depths


def _positive(**values) -> None:
    for flag, value in values.items():
        if value < 1:
            raise DynoError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")


def _check_data(path: str) -> None:
    """An unreadable or empty data file fails before the model loads."""
    try:
        raw = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise DynoError(f"cannot read the data file {path}: {e.strerror or e}") from None
    if not raw.strip():
        raise DynoError(f"the data file {path} is empty")


def _load(args):
    from speculative import load_model

    from ..paths import default_model

    # mtp: no head is an error; the whole vocabulary and a fixed depth: nothing timed or ranked at load.
    return load_model(args.model or default_model(), mode="mtp", draft_depth=3, draft_vocab=None,
                      mtp_head=args.mtp_head, mtp_base=args.mtp_base, head_bits=16, notify=notify)[0]


def cmd_head_eval(args) -> int:
    import json

    from speculative.measure import head_eval as evaluate
    from speculative.measure.corpus import eval_prompts, read_corpus

    depths = _depths(args.depths)
    _positive(prompts=args.prompts, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    if args.temp < 0:
        raise DynoError(f"--temp must be >= 0, got {args.temp}")
    _check_data(args.data)
    lm = _load(args)
    prompts = eval_prompts(read_corpus(args.data, lm.tokenizer), args.prompts, args.prompt_tokens)
    temps = [0.0] + ([args.temp] if args.temp > 0 else [])
    results = []
    for r in evaluate.sweep(lm, prompts, depths, temps, args.max_tokens, args.seed):
        results.append(r)
        if not args.json:
            print(f"dyno: depth {r.depth}, {'greedy' if not r.temperature else f'temperature {r.temperature:g}'}: "
                  f"{r.stats.tokens_per_round or 1.0:.3f} tokens per round", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"model": str(lm.path), "head": lm.head_source, "data": args.data, "prompts": len(prompts),
                          "max_tokens": args.max_tokens, "seed": args.seed,
                          "results": [r.as_dict() for r in results]}, indent=1))
    else:
        print("\n".join(evaluate.table(results, f"MTP head {lm.head_source} on {args.data} "
                                                f"({len(prompts)} prompts x {args.max_tokens} tokens)")))
    return 0


def cmd_head_tune(args) -> int:
    from speculative.measure import head_tune as tuning

    settings = tuning.TuneSettings(steps=args.steps, seq_len=args.seq_len, batch=args.batch, lr=args.lr,
                                   depth=args.depth, top_k=args.top_k, continue_tokens=args.continue_tokens,
                                   continue_temperature=args.continue_temp, seed=args.seed)
    _positive(eval_prompts=args.eval_prompts)
    out = Path(args.out).expanduser()
    if out.exists() and not args.overwrite:
        raise DynoError(f"{out} exists; pass --overwrite to replace it")
    # A tune never touches what it starts from, --overwrite or not.
    for given, what in ((getattr(args, "mtp_head", None), "the head this tune starts from (--mtp-head)"),
                        (getattr(args, "model", None), "the model's folder (--model)")):
        if given and Path(given).expanduser().exists() and out.resolve() == Path(given).expanduser().resolve():
            raise DynoError(f"--out {out} is {what}; write the tuned head to another folder")
    for path in [args.data] + ([args.eval_data] if args.eval_data else []):
        _check_data(path)
    from .head_tune import tune

    return tune(_load(args), args, settings, out)


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
