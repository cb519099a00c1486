"""One long session: tokens/s per turn, plain decoding against drafting at fixed depths, as the context grows.

    python tools/long_session.py --model assets/dyno-tiny --acceptance 27b-long --contexts 1024:32768 \
        --measure-up-to 4096 --max-tokens 32 --json out.json
    tools/with_openblas.sh python tools/long_session.py --shape qwen3.5-0.8b --dtype float32 --keep /tmp/q08 \
        --acceptance 27b-long --contexts 1024:32768 --measure-up-to 2048 --max-tokens 32

The long-session mode of tools/scale_bench.py (tools/standin/session.py): one session's prompt
grown turn by turn (contexts doubling from the first to the last), `--max-tokens` decoded each turn,
drafts replayed to an acceptance profile that may follow the context (`--acceptance 27b-long`:
Qwen3.6-27B's published decay; or points like 1k:0.93,0.86,0.75/32k:0.72,0.66,0.58). Turns up to
`--measure-up-to` tokens run for real (plain and each depth, output checked equal); every turn is
also timed by the cost model with its attention padded to the turn's context, and turns past what
was run are reported from it alone ("model" in the table). `--model DIR` runs a checkpoint as it is
(the bundled dyno-tiny); `--shape` builds a random real-shaped one as scale_bench does.
"""

import argparse
import json
import platform
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools.standin, run as a script

import mlx.core as mx
import mlx_lm

from speculative.errors import DynoError
from speculative.loader import load_checkpoint
from tools.standin import shapes
from speculative.measure.blas import detect
from tools.standin.random_checkpoint import built, scaled_down
from speculative.measure.replay import ContextProfile, parse_profile
from tools.standin.scale import draft_vocab_floor
from tools.standin.session import doubling, long_session, tps
from speculative.prompt_cache.store import PrefixCache


def contexts_of(text: str):
    """FIRST:LAST (doubling) or a comma-separated increasing list of token counts."""
    first, sep, last = text.partition(":")
    if sep:
        return doubling(int(first), int(last))
    out = [int(c) for c in text.split(",")]
    if any(b <= a for a, b in zip(out, out[1:])) or out[0] < 1:
        raise ValueError("contexts must increase")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a checkpoint folder, run as it is (e.g. assets/dyno-tiny)")
    which.add_argument("--shape", choices=shapes.names(), help="a random checkpoint of this shape, built for the run")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--shape's float type")
    ap.add_argument("--scaled-down", action="store_true", help="--shape with its widths cut down (a smoke test)")
    ap.add_argument("--keep", metavar="DIR", help="--shape: build the checkpoint in DIR and leave it, or reuse it")
    ap.add_argument("--root", help="--shape: where the temporary checkpoint goes")
    ap.add_argument("--acceptance", default="27b-long",
                    help="profile: a name, rates like 0.93,0.86,0.75, or points like 1k:0.93,0.86,0.75/32k:0.72,0.66,0.58")
    ap.add_argument("--draft-vocab", default="full", metavar="N|auto|full",
                    help="rows the drafts project onto (auto: its floor, 1/8 of the vocabulary; default: full)")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--contexts", default="1024:32768", help="FIRST:LAST (doubling) or a comma-separated list")
    ap.add_argument("--measure-up-to", type=int, default=4096, help="turns up to this many tokens run for real")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens decoded each turn")
    ap.add_argument("--pairs", type=int, default=1, help="plain and depth runs alternated this many times a turn")
    ap.add_argument("--reps", type=int, default=5, help="cost-model rounds a turn")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # a built checkpoint is removed
    try:
        profile = parse_profile(args.acceptance, by_context=True)
    except DynoError as e:
        ap.error(e.message)
    try:
        depths = [int(d) for d in args.depths.split(",")]
        contexts = contexts_of(args.contexts)
    except ValueError:
        ap.error(f"--depths takes numbers like 1,2,3 and --contexts FIRST:LAST or increasing numbers: "
                 f"{args.depths!r}, {args.contexts!r}")
    if not depths or min(depths) < 1 or max(depths) > len(profile):
        ap.error(f"--depths must be from 1 to the profile's {len(profile)} positions: {args.depths!r}")
    for name in ("max_tokens", "pairs", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1: {getattr(args, name)}")
    if args.model and not Path(args.model).is_dir():
        ap.error(f"--model: no checkpoint folder at {args.model}")
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    blas = detect()
    say(blas.line())
    points = profile.points if isinstance(profile, ContextProfile) else ((0, profile),)
    record = {"model": args.model or args.shape, "dtype": args.dtype if args.shape else "as stored",
              "acceptance": args.acceptance, "profile": [[c, list(r)] for c, r in points],
              "blas": blas.as_json(), "settings": vars(args),
              "machine": {"platform": platform.platform(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                          "backend": str(mx.default_device())},
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.shape:
        config = shapes.load(args.shape)["text_config"]
        checkpoint = built(scaled_down(config) if args.scaled_down else config, root=args.root,
                           dtype=getattr(mx, args.dtype), keep=args.keep)
    else:
        checkpoint = nullcontext((Path(args.model), None))
    with checkpoint as (model, head):
        lm = load_checkpoint(model, mode="mtp", mtp_head=str(head) if head else None)
        vocab = lm.target.args.vocab_size
        if args.draft_vocab in ("full", "auto"):
            draft_vocab = draft_vocab_floor(vocab) if args.draft_vocab == "auto" else None
        elif args.draft_vocab.isdigit() and 0 < int(args.draft_vocab) < vocab:
            draft_vocab = int(args.draft_vocab)
        else:
            ap.error(f"--draft-vocab must be full, auto or a number of tokens below {vocab}: {args.draft_vocab!r}")
        try:
            record.update(long_session(lm, contexts, depths, profile, args.max_tokens, args.measure_up_to,
                                       args.pairs, args.reps, draft_vocab=draft_vocab, cache=PrefixCache(),
                                       notify=say))
        except DynoError as e:
            ap.error(e.message)
        del lm
    print_table(record)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
        say(f"wrote {args.json}")
    return 0


def ratio(turn, k: str) -> float:
    """Depth k over plain: the median of the pairs' ratios where the turn ran, else the model's."""
    m = turn.get("measured")
    return m["depths"][k]["ratio"]["median"] if m else tps(turn, k) / tps(turn, "plain")


def print_table(record) -> None:
    depths = [str(k) for k in record["depths"]]
    drafts = f"drafts over {record['draft_vocab']} tokens" if record.get("draft_vocab") else "drafts over the whole vocabulary"
    print(f"{record['model']} ({record['dtype']}), acceptance {record['acceptance']}, {record['max_tokens']} tokens "
          f"a turn, {drafts}, {record['machine']['backend']}, BLAS: {record['blas']['name']}")
    # x: over plain (a turn that ran: the median of its pairs' ratios)
    print(f"{'context':>7} {'from':>5} {'p1':>5} {'p2':>5} {'p3':>5} {'plain':>7} " +
          " ".join(f"{'d' + k + ' tok/s':>10} {'x':>5}" for k in depths) + f" {'best':>5}")
    for t in record["turns"]:
        rates = (t["rates"] + [float("nan")] * 3)[:3]
        plain = tps(t, "plain")
        speeds = {k: tps(t, k) for k in depths}
        best = max(speeds, key=speeds.get)
        best = best if speeds[best] > plain else "plain"
        print(f"{t['context']:>7} {'run' if 'measured' in t else 'model':>5} " + " ".join(f"{r:>5.2f}" for r in rates) +
              f" {plain:>7.1f} " + " ".join(f"{speeds[k]:>10.1f} {ratio(t, k):>5.2f}" for k in depths) +
              f" {best:>5}")
    s = record["session"]
    print("whole session, over plain: " + ", ".join(f"depth {k} {s['speedup'][k]:.2f}x" for k in depths) +
          f"; the best choice each turn {s['best_each_turn_speedup']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
