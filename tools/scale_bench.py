"""Speed at real scale: a real-shaped Qwen3.5/3.6 model (random weights), replayed acceptance.

    python tools/scale_bench.py --shape qwen3.5-0.8b --bits 16 --acceptance 27b-code --depths 1,2,3 \
        --context 64 --max-tokens 32 --pairs 3 --json out.json

Builds the checkpoint (speculative/measure/random_checkpoint.py) in a temporary folder, removed at
the end; times T1, Tv(k), Td (whole vocabulary and auto's smallest draft vocabulary); runs plain
mlx-lm and Dyno at each depth in alternating pairs, Dyno's drafts replayed to the acceptance profile
(speculative/measure/replay.py), output checked equal to plain greedy; prints a table and writes a
JSON record. `--padded 8192,32768` adds contexts timed by the cost model alone, their attention caches
padded with random rows (no prefill: minutes per thousand tokens on a slow CPU): the bound, not a speedup.
"""

import argparse
import json
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

from speculative.attention_kernels import deepest_vector_depth, metal_attention_kernel
from speculative.loader import load_checkpoint
from speculative.measure import shapes
from speculative.measure.random_checkpoint import built
from speculative.measure.replay import parse_profile
from speculative.measure.scale import measure_context, random_prompt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, choices=shapes.names())
    ap.add_argument("--bits", type=int, default=16, choices=[16, 8, 4])
    ap.add_argument("--acceptance", default="27b-code", help="profile name or rates, e.g. 0.93,0.86,0.75")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--context", default="64", help="prompt lengths in tokens, comma-separated (paired runs)")
    ap.add_argument("--pad-prompt", type=int, default=16, help="prompt length before the padding of --padded")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7, help="cost-model rounds")
    ap.add_argument("--padded", default="", help="contexts (comma-separated) timed by the cost model only, the "
                    "attention caches padded with random rows to that length after a short prompt (no prefill)")
    ap.add_argument("--root", help="where the temporary checkpoint goes (default: the system's temp dir)")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args()
    # A stopped run (kill, timeout) exits through `built`'s cleanup: its checkpoint takes gigabytes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    depths = [int(d) for d in args.depths.split(",")]
    profile = parse_profile(args.acceptance)
    if len(profile) < max(depths):
        ap.error(f"the profile has {len(profile)} positions; --depths goes to {max(depths)}")
    contexts = [int(c) for c in args.context.split(",") if c]
    padded = [int(c) for c in args.padded.split(",") if c]
    shape = shapes.load(args.shape)
    config = shape["text_config"]
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    record = {"shape": args.shape, "source": shape["source"], "bits": args.bits, "profile": list(profile),
              "settings": vars(args), "parameters": shapes.parameter_count(config),
              "machine": {"platform": platform.platform(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                          "backend": str(mx.default_device())},
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "metal_attention": {k: metal_attention_kernel(config, k + 1) for k in range(1, 9)},
              "metal_vector_max_depth": deepest_vector_depth(config), "contexts": []}
    start = time.perf_counter()
    with built(config, bits=args.bits, root=args.root) as (model, head):
        say(f"built {args.shape} at {args.bits} bits in {time.perf_counter() - start:.0f}s")
        lm = load_checkpoint(model, mode="mtp", mtp_head=str(head) if head else None)
        for n in contexts:
            say(f"context {n}")
            record["contexts"].append(measure_context(lm, random_prompt(n), depths, profile, args.max_tokens,
                                                      args.pairs, args.reps, notify=say))
        for n in padded:
            say(f"context {n}, padded")
            record["contexts"].append(measure_context(lm, random_prompt(args.pad_prompt), depths, profile, args.max_tokens,
                                                      args.pairs, args.reps, paired=False, padded_to=n, notify=say))
        del lm
    print_table(record)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
        say(f"wrote {args.json}")
    return 0


def print_table(record) -> None:
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    print(f"{record['shape']} {record['bits']}-bit, acceptance {record['profile']}, {record['machine']['backend']}")
    print(f"{'context':>7} {'depth':>5} {'T1 ms':>6} {'Tv ms':>6} {'Tv/T1':>5} {'Td ms':>6} {'Td sub':>6} "
          f"{'tok/rnd':>7} {'bound':>5} {'b.sub':>5} {'speedup (min-max)':>18} {'eff':>5} {'metal attn':>10}")
    for c in record["contexts"]:
        cm = c["cost_model"]
        for k, d in c["depths"].items():
            k = int(k)
            r = d.get("ratio")
            sp = f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
            eff = f"{d['efficiency']:.2f}" if "efficiency" in d else "-"
            print(f"{str(c['context']) + ('p' if c.get('padded') else ''):>7} {k:>5} {ms(cm['T1']):>6} {ms(cm['Tv'][k]):>6} {d['tv_over_t1']:>5.2f} "
                  f"{ms(cm['Td']):>6} {ms(cm['Td_draft_vocab']):>6} {d['tokens_per_round']:>7.2f} {d['bound']:>5.2f} "
                  f"{d['bound_draft_vocab']:>5.2f} {sp:>18} {eff:>5} {record['metal_attention'][k]:>10}")
        if "plain" in c:
            p = c["plain"]
            print(f"{'':>7} prefill: mlx-lm {p['prefill_s']['median']:.2f}s, Dyno " +
                  " ".join(f"{d['prefill_s']['median']:.2f}s@{k}" for k, d in c["depths"].items()) +
                  f"; plain decode {p['decode_tps']['median']:.2f} tok/s, its step {p['step_over_t1']:.2f}x T1; "
                  "round / model calls: " + " ".join(f"{ms(d['round_s'])}/{ms(d['model_calls_s'])}ms@{k}"
                                                       for k, d in c["depths"].items()))


if __name__ == "__main__":
    sys.exit(main())
