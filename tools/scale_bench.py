"""Speed at real scale: a real-shaped Qwen3.5/3.6 model (random weights), replayed acceptance.

    python tools/scale_bench.py --shape qwen3.5-0.8b --bits 16 --acceptance 27b-code --depths 1,2,3 \
        --context 64 --max-tokens 32 --pairs 3 --json out.json
    tools/with_openblas.sh python tools/scale_bench.py --shape qwen3.5-0.8b --dtype float32 --draft-vocab auto ...

Builds the checkpoint (tools/standin/random_checkpoint.py) in a temporary folder, removed at
the end; times T1, Tv(k), Td (whole vocabulary and auto's smallest draft vocabulary); runs plain
mlx-lm and Dyno at each depth in alternating pairs, Dyno's drafts replayed to the acceptance profile
(speculative/measure/replay.py), output checked equal to plain greedy; prints a table and writes a
JSON record. `--padded 8192,32768` adds contexts timed by the cost model alone, their attention caches
padded with random rows (no prefill: minutes per thousand tokens on a slow CPU): the bound, not a speedup.

`--dtype float32` with OpenBLAS preloaded (tools/with_openblas.sh) is the bandwidth-bound stand-in for
decoding on Apple Silicon (docs/performance.md); the record and the table name the BLAS the run used.
`--draft-vocab N|auto` drafts over N rows (auto: its floor, 1/8 of the vocabulary), the subset made by
tools/standin/scale.py's draft_subset (`--draft-ids first|seeded`) and labelled in the record.
`--tune` also runs `dyno tune`'s procedure with the drafts replayed (a random head accepts nothing, so
the command itself cannot be run on such a model) and prints the depth it picks.
One session grown turn by turn to long contexts, acceptance decaying with it: tools/long_session.py.
"""

import argparse
import json
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools.standin, run as a script

import mlx.core as mx
import mlx_lm

from speculative.attention_kernels import deepest_vector_depth, metal_attention_kernel
from speculative.draft_vocab.head import lm_head_module
from speculative.loader import load_checkpoint
from tools.standin import shapes
from speculative.measure.blas import compute_bound_note, detect
from tools.standin.random_checkpoint import built, dtype_name, scaled_down
from speculative.measure.replay import parse_profile
from tools.standin.scale import draft_vocab_floor, measure_context, random_prompt, tune_replayed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, choices=shapes.names())
    ap.add_argument("--bits", type=int, default=16, choices=[16, 8, 4])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the checkpoint's float type (float32: products through the BLAS; with --bits, what stays unquantized)")
    ap.add_argument("--draft-vocab", default="full", metavar="N|auto|full",
                    help="rows the replayed drafts project onto (auto: its floor, 1/8 of the vocabulary; default: full)")
    ap.add_argument("--draft-ids", default="first", choices=["first", "seeded"],
                    help="after the reference run's tokens, fill the draft vocabulary with the lowest ids or a seeded draw")
    ap.add_argument("--acceptance", default="27b-code", help="profile name or rates, e.g. 0.93,0.86,0.75")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--context", default="64", help="prompt lengths in tokens, comma-separated (paired runs)")
    ap.add_argument("--pad-prompt", type=int, default=16, help="prompt length before the padding of --padded")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7, help="cost-model rounds")
    ap.add_argument("--pair-reps", type=int, default=3,
                    help="cost-model rounds timed again after each pair, for each pair's efficiency (0: none)")
    ap.add_argument("--padded", default="", help="contexts (comma-separated) timed by the cost model only, the "
                    "attention caches padded with random rows to that length after a short prompt (no prefill)")
    ap.add_argument("--root", help="where the temporary checkpoint goes (default: the system's temp dir)")
    ap.add_argument("--scaled-down", action="store_true",
                    help="the shape with its widths cut down (random_checkpoint.scaled_down): a smoke test of the tool")
    ap.add_argument("--keep", metavar="DIR", help="with --bits 16: build the checkpoint in DIR and leave it there, or "
                    "reuse the one an earlier run left in DIR (remove it yourself: a 0.8B in float32 takes 3 GB)")
    ap.add_argument("--tune", action="store_true",
                    help="also run `dyno tune`'s procedure (its two prompts, paired at each of --depths, drafts "
                         "replayed) and report the depth it picks beside the pairs' fastest")
    ap.add_argument("--tune-pairs", type=int, default=3, help="its pairs per depth (dyno tune's default: 3)")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args()
    # A stopped run (kill, timeout) exits through `built`'s cleanup: its checkpoint takes gigabytes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.tune_pairs < 1:
        ap.error(f"--tune-pairs must be at least 1: {args.tune_pairs}")
    if args.pair_reps < 0:
        ap.error(f"--pair-reps must be 0 or more: {args.pair_reps}")
    depths = [int(d) for d in args.depths.split(",")]
    profile = parse_profile(args.acceptance)
    if len(profile) < max(depths):
        ap.error(f"the profile has {len(profile)} positions; --depths goes to {max(depths)}")
    shape = shapes.load(args.shape)
    config = scaled_down(shape["text_config"]) if args.scaled_down else shape["text_config"]
    vocab_size = config["vocab_size"]
    if args.draft_vocab == "full":
        draft_vocab = None
    elif args.draft_vocab == "auto":
        draft_vocab = draft_vocab_floor(vocab_size)
    elif args.draft_vocab.isdigit() and 0 < int(args.draft_vocab) < vocab_size:
        draft_vocab = int(args.draft_vocab)
    else:
        ap.error(f"--draft-vocab must be full, auto or a number of tokens below {vocab_size}: {args.draft_vocab!r}")
    if args.keep and args.bits != 16:
        ap.error("--keep needs --bits 16")
    contexts = [int(c) for c in args.context.split(",") if c]
    padded = [int(c) for c in args.padded.split(",") if c]
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    blas = detect()
    say(blas.line())
    record = {"shape": args.shape, "source": shape["source"], "bits": args.bits, "dtype": args.dtype,
              "draft_vocab": draft_vocab, "profile": list(profile), "blas": blas.as_json(),
              "settings": vars(args), "parameters": shapes.parameter_count(config),
              "machine": {"platform": platform.platform(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                          "backend": str(mx.default_device())},
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "metal_attention": {k: metal_attention_kernel(config, k + 1) for k in range(1, 9)},
              "metal_vector_max_depth": deepest_vector_depth(config), "contexts": []}
    start = time.perf_counter()
    with built(config, bits=args.bits, root=args.root, dtype=getattr(mx, args.dtype), keep=args.keep) as (model, head):
        say(f"built {args.shape} ({args.dtype}, {args.bits} bits) in {time.perf_counter() - start:.0f}s")
        lm = load_checkpoint(model, mode="mtp", mtp_head=str(head) if head else None)
        # What the products ran in, as loaded (not as asked): the trunk's vocabulary rows and the head's.
        record["loaded_dtype"] = {"lm_head": dtype_name(lm_head_module(lm.target).weight.dtype),
                                  "mtp_head": dtype_name(lm.head.fc.weight.dtype)}
        for n in contexts:
            say(f"context {n}")
            record["contexts"].append(measure_context(lm, random_prompt(n), depths, profile, args.max_tokens,
                                                      args.pairs, args.reps, notify=say, draft_vocab=draft_vocab,
                                                      draft_ids=args.draft_ids, pair_reps=args.pair_reps))
        for n in padded:
            say(f"context {n}, padded")
            record["contexts"].append(measure_context(lm, random_prompt(args.pad_prompt), depths, profile, args.max_tokens,
                                                      args.pairs, args.reps, paired=False, padded_to=n, notify=say,
                                                      draft_vocab=draft_vocab, draft_ids=args.draft_ids))
        if args.tune:
            say("dyno tune's procedure")
            record["tune"] = tune_replayed(lm, profile, args.max_tokens, args.tune_pairs, depths, draft_vocab,
                                           args.draft_ids)
        del lm
    print_table(record)
    if (note := compute_bound_note(blas)) and args.dtype == "float32" and args.bits == 16:
        print(note)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
        say(f"wrote {args.json}")
    return 0


def print_table(record) -> None:
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    precision = record.get("dtype", "bfloat16") if record["bits"] == 16 else f"{record['bits']}-bit"
    drafts = f"drafts over {record['draft_vocab']} tokens" if record.get("draft_vocab") else "drafts over the whole vocabulary"
    print(f"{record['shape']} {precision}, acceptance {record['profile']}, {drafts} (eff against "
          f"{'b.sub' if record.get('draft_vocab') else 'bound'}), {record['machine']['backend']}")
    if "blas" in record:
        print(f"BLAS: {record['blas']['name']} ({record['blas']['path']})")
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
        estimate = c.get("auto_estimate")
        if estimate is not None:
            paired = {int(k): d["ratio"]["median"] for k, d in c["depths"].items() if d.get("ratio")}
            fastest = f"; the pairs' fastest: depth {max(paired, key=paired.get)}" if paired else ""
            print(f"{'':>7} --draft-depth auto's estimate (cost model, the profile's acceptance): depth {estimate}{fastest}")
        if "plain" in c:
            p = c["plain"]
            print(f"{'':>7} prefill: mlx-lm {p['prefill_s']['median']:.2f}s, Dyno " +
                  " ".join(f"{d['prefill_s']['median']:.2f}s@{k}" for k, d in c["depths"].items()) +
                  f"; plain decode {p['decode_tps']['median']:.2f} tok/s, its step {p['step_over_t1']:.2f}x T1; "
                  "round / model calls: " + " ".join(f"{ms(d['round_s'])}/{ms(d['model_calls_s'])}ms@{k}"
                                                       for k, d in c["depths"].items()))
            if "paired_step_over_t1" in p:  # the model calls timed again after each pair
                fmt = lambda r: f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"  # noqa: E731
                print(f"{'':>7} beside each pair: plain's step {fmt(p['paired_step_over_t1'])}x T1; " +
                      "; ".join(f"depth {k}: efficiency {fmt(d['paired']['efficiency'])}, round / calls "
                                f"{fmt(d['paired']['round_over_calls'])}" for k, d in c["depths"].items()))
    if "tune" in record:
        t = record["tune"]
        print(f"dyno tune's procedure ({t['prompts']} prompts, {t['max_tokens']} tokens, {t['pairs']} pairs, "
              f"replayed): depth {t['pick']} (" + ", ".join(f"{k}: {v:.2f}x" for k, v in t["speedup"].items()) + ")")


if __name__ == "__main__":
    sys.exit(main())
