"""Exact at long context: a multi-turn session resumed from the prompt cache against plain mlx-lm cold.

    python tools/long_exact.py --model assets/dyno-tiny --contexts 1500,4096 --json out.json
    tools/with_openblas.sh python tools/long_exact.py --shape qwen3.5-0.8b --dtype float32 --keep /tmp/q08 \
        --contexts 1500,4096,8192,16384 --json assets/bench/qwen3.5-0.8b-f32-openblas-long-exact-cpu.json

One conversation of random ordinary tokens grown to each context in turn: a user message, then a
greedy answer of `--max-tokens` drafted at `--depth`, every turn after the first resumed from the
prompt cache (message starts checkpointed, as a chat's are); each answer is checked token for
token against mlx-lm's generate_step run cold on the whole conversation (speculative/measure/exact.py).
`--chunk-check N:AT:STEP` also prefills an N-token prompt as mlx-lm chunks it (every STEP from 0)
and as a turn resumed at AT chunks it, and prints how far apart the last row's logits and the caches
came out (0: chunk boundaries change no bit). The record is written after every turn, so a run cut
short keeps what it measured.
"""

import argparse
import json
import platform
import random
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools.standin, run as a script

import mlx.core as mx
import mlx_lm

from speculative.loader import load_checkpoint
from tools.standin import shapes
from speculative.measure.blas import detect
from speculative.measure.exact import chunk_bits, long_exact_session, messages
from tools.standin.random_checkpoint import built
from speculative.prompt_cache.store import PrefixCache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a checkpoint folder, run as it is (e.g. assets/dyno-tiny)")
    which.add_argument("--shape", choices=shapes.names(), help="a random checkpoint of this shape, built for the run")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--shape's float type")
    ap.add_argument("--keep", metavar="DIR", help="--shape: build the checkpoint in DIR and leave it, or reuse it")
    ap.add_argument("--contexts", default="1500,4096,8192,16384", help="increasing token counts, one turn each")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens answered each turn")
    ap.add_argument("--depth", type=int, default=3, help="draft depth")
    ap.add_argument("--chunk-check", metavar="N:AT:STEP", help="also compare chunkings of an N-token prompt")
    ap.add_argument("--json", help="write the record here (after every turn)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # a built checkpoint is removed
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        check = [int(x) for x in args.chunk_check.split(":")] if args.chunk_check else None
    except ValueError:
        ap.error(f"--contexts takes increasing numbers like 1500,4096 and --chunk-check N:AT:STEP: "
                 f"{args.contexts!r}, {args.chunk_check!r}")
    if any(b <= a for a, b in zip(contexts, contexts[1:])) or contexts[0] <= args.max_tokens:
        ap.error(f"--contexts must increase from above --max-tokens ({args.max_tokens}): {args.contexts!r}")
    if check is not None and (len(check) != 3 or not 0 < check[1] < check[0] - 1 or check[2] < 1):
        ap.error(f"--chunk-check takes N:AT:STEP with 0 < AT < N - 1 and STEP >= 1: {args.chunk_check!r}")
    if args.model and not Path(args.model).is_dir():
        ap.error(f"--model: no checkpoint folder at {args.model}")
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    blas = detect()
    say(blas.line())
    record = {"model": args.model or args.shape, "dtype": args.dtype if args.shape else "as stored",
              "blas": blas.as_json(), "settings": vars(args), "command": " ".join(sys.argv),
              "machine": {"platform": platform.platform(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                          "backend": str(mx.default_device())},
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "turns": []}

    def write():
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1))

    checkpoint = (built(shapes.load(args.shape)["text_config"], dtype=getattr(mx, args.dtype), keep=args.keep)
                  if args.shape else nullcontext((Path(args.model), None)))
    with checkpoint as (model, head):
        lm = load_checkpoint(model, mode="mtp", mtp_head=str(head) if head else None)
        if check is not None:
            n, at, step = check
            prompt = messages(n, random.Random(1), lm.vocab_size)
            bits = chunk_bits(lm, prompt, at, cuts=[at + (n - at) // 2], step=step)
            record["chunk_check"] = bits
            say(f"chunks of {n} tokens, cold every {step} against resumed at {at}: last row's logits apart by "
                f"{bits['logits']}, caches by {bits['caches']}")
            write()

        for t in long_exact_session(lm, PrefixCache(), contexts, args.max_tokens, args.depth):
            record["turns"].append(t)
            write()
            say(f"turn at {t['context']} tokens: {t['restored']} restored, "
                + ("identical" if t["identical"] else f"DIFFERS at token {t['first_difference']}")
                + f" ({t['dyno_s']}s, cold {t['cold_s']}s)")
    write()
    if args.json:
        say(f"wrote {args.json}")
    return 0 if all(t["identical"] for t in record["turns"]) else 1


if __name__ == "__main__":
    sys.exit(main())
