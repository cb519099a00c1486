"""Aggregate tokens per second of B greedy requests at once: batched drafting against plain batching
(mlx-lm's BatchGenerator) and against serial drafting (one request at a time).

    python tools/batched_speed.py [--model assets/dyno-tiny] [--rows 1 2 4] [--depths 1 2 3]
                                  [--max-tokens 128] [--repeats 5] [--serial-depth 3] [--json FILE]
    tools/with_openblas.sh python tools/batched_speed.py --shape qwen3.5-0.8b --dtype float32 \
        --acceptance 27b-code --draft-vocab auto --rows 2 4 --depths 0 1 2 3 --policy --max-tokens 24 --repeats 5

`--shape` builds a random checkpoint at a real model's shape (as tools/scale_bench.py does; removed
at the end) and replays each row's drafts to an acceptance profile against that row's plain greedy
tokens (speculative/measure/replay.py, replayed_batch); `--draft-vocab auto` drafts over auto's
smallest draft vocabulary (scale.py's draft_subset, filled with the lowest ids after the rows'
reference tokens). Each row's prompt is `--context` seeded random tokens. `--policy` adds the default
server's automatic depth: its batched rounds timed at the shape first (as a first `dyno serve` start
times them), the profile as its prior acceptance, then each round's depth its pick for the width.

Each run starts from the prompts (the rows prefilled together, as BatchGenerator does) and ends at the last row's last token; the
tokens are B x max_tokens unless a row reaches EOS (then the same for every method: greedy texts
are checked to be identical). Per width the methods run in a rotating order each repeat, so no
method always runs first; reported: the median aggregate tokens/s over the repeats (min-max) and
the median ratio to plain batching within the same repeat, both for the whole run and for its
decoding phase (the tokens after each row's first, over the time after every row had its first:
at a real shape a prompt's prefill takes seconds and would hide what the rounds gain).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from speculative.batched import BatchSpeculator, Joiner  # noqa: E402
from speculative.config import SamplingParams, SpecConfig  # noqa: E402
from speculative.engine import generate  # noqa: E402
from speculative.events import Token  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from tools.standin import shapes  # noqa: E402
from speculative.measure.blas import detect  # noqa: E402
from tools.standin.random_checkpoint import built, scaled_down  # noqa: E402
from speculative.measure.batch_cost import measure_batch_costs  # noqa: E402
from speculative.measure.replay import replayed_batch, parse_profile  # noqa: E402
from speculative.round.drafter import HeadDrafter  # noqa: E402
from speculative.measure.batch_cost import TIMED_DEPTH  # noqa: E402
from speculative.round.depth_policy import DepthPolicy, RoundTimer  # noqa: E402
from tools.standin.scale import draft_head, draft_vocab_floor, random_prompt  # noqa: E402
from speculative.measure.suites import SUITES, encode  # noqa: E402


def batched_drafting(lm, prompts, n, policy, make=BatchSpeculator, depths=None):
    """Rows join together (one prefill, as the server's requests that arrive together), then rounds at
    the depth `policy` picks for the width (a pinned DepthPolicy: one depth; the server's: it records
    the rounds' times and learns acceptance from them, as `dyno serve`'s default runs) until every row
    is done; returns the tokens and when every row had its first one. Counts each depth's rounds into
    `depths` when given."""
    batch = make(lm)
    joined = batch.join_all([Joiner(i, p, SamplingParams(max_tokens=n)) for i, p in enumerate(prompts)])
    out = {i: [e.id for e in r.events] for i, r in joined.items()}
    decoding, timer = time.perf_counter(), RoundTimer(policy.record)
    while batch:
        width = len(batch)
        k, then = policy.depth_for(width), policy.peek(width)
        if depths is not None:
            depths[k] = depths.get(k, 0) + 1
        timer.start(width, k, then)
        rounds = batch.step(k, then)
        policy.observe(e for r in rounds.values() for e in r.events)
        for i, r in rounds.items():
            out[i] += [e.id for e in r.events if isinstance(e, Token)]
    timer.skip()
    return out, decoding


def server_policy(lm, prompt, widths, profile, head):
    """The default server's depth policy at this shape: its batched rounds' costs timed here first
    (measure_batch_costs, what a first `dyno serve` start does), the profile as the acceptance
    `dyno tune` would have stored."""
    def make():
        batch = BatchSpeculator(lm, drafter=HeadDrafter(head))
        if head is not None:  # the draft step timed for the policy (D(B)) reads the batch's own projection
            batch.draft_lm_head = head
        return batch

    started = time.perf_counter()
    costs = measure_batch_costs(lm, prompt, widths=widths, reps=3, make=make)
    policy = DepthPolicy(costs, list(profile))
    print(f"timed the batched rounds for the policy in {time.perf_counter() - started:.0f}s; at first it picks "
          + ", ".join(f"depth {policy.best_depth(w)} at {w} rows" for w in widths))
    return policy


def plain_batching(lm, prompts, n):
    """mlx-lm's BatchGenerator with every row in one batch (what `--decode-concurrency` runs)."""
    gen = BatchGenerator(lm.model, stop_tokens=[[t] for t in lm.eos_token_ids],
                         completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    out, left, decoding = {u: [] for u in uids}, len(uids), None
    while left:
        for r in gen.next_generated():
            out[r.uid].append(int(r.token))
            left -= r.finish_reason is not None
        if decoding is None and all(out.values()):
            decoding = time.perf_counter()
    gen.close()
    return {i: out[u] for i, u in enumerate(uids)}, decoding


def serial_drafting(lm, prompts, n, depth):
    """One request after another through engine.generate (the driver at width 1, `--decode-concurrency 1`);
    its decoding phase is not one span, so none is given."""
    return {i: [e.id for e in generate(lm, p, SamplingParams(max_tokens=n), SpecConfig("mtp", depth))
                if isinstance(e, Token)] for i, p in enumerate(prompts)}, None


def timed(fn):
    """(tokens, the whole run's seconds, the seconds after every row had its first token or None)."""
    mx.synchronize()
    start = time.perf_counter()
    out, decoding = fn()
    mx.synchronize()
    end = time.perf_counter()
    return out, end - start, None if decoding is None else end - decoding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "assets" / "dyno-tiny"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--serial-depth", type=int, default=3, help="0: none (with --shape: none; its drafts are not replayed)")
    ap.add_argument("--shape", choices=shapes.names(), help="a random checkpoint at this model's shape, drafts replayed")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="with --shape: its float type")
    ap.add_argument("--acceptance", default="27b-code", help="with --shape: the replayed profile, a name or rates")
    ap.add_argument("--draft-vocab", default="full", choices=["full", "auto"], help="with --shape: rows the drafts project onto")
    ap.add_argument("--context", type=int, default=64, help="with --shape: each row's prompt length")
    ap.add_argument("--policy", action="store_true",
                    help="with --shape: also each round at the default server's depth (its costs timed here first)")
    ap.add_argument("--scaled-down", action="store_true", help="with --shape: its widths cut down (a smoke test)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.policy and args.shape is None:
        ap.error("--policy needs --shape (its drafts are replayed to the profile the policy starts from)")
    if args.shape is None:
        run(args, load_checkpoint(args.model), args.model)
        return
    # A stopped run (kill, timeout) exits through `built`'s cleanup: its checkpoint takes gigabytes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    profile = parse_profile(args.acceptance)
    config = shapes.load(args.shape)["text_config"]
    config = scaled_down(config) if args.scaled_down else config
    print(detect().line())
    with built(config, dtype=getattr(mx, args.dtype)) as (model, _):
        run(args, load_checkpoint(model, mode="mtp"), f"{args.shape} ({args.dtype}, random, drafts replayed to {list(profile)})",
            profile)


def replayed(lm, prompts, n, depth, profile, draft_vocab):
    """The rows' plain greedy references (BatchGenerator, n + depth tokens) and a maker of batches whose
    drafts follow `profile` against them, over the draft vocabulary when `draft_vocab` is auto (its
    DraftLMHead, else None, returned too)."""
    references, _ = plain_batching(lm, prompts, n + depth)
    head = None
    if draft_vocab == "auto":
        floor = draft_vocab_floor(lm.target.args.vocab_size)
        head = draft_head(lm, floor, [t for ref in references.values() for t in ref])
    return (lambda lm: replayed_batch(lm, references, profile, draft_head=head)), head


def run(args, lm, label, profile=None) -> None:
    items = SUITES["code"] + SUITES["reasoning"]
    n = args.max_tokens
    print(f"MLX {mx.__version__}, {mx.default_device()}, {label}, {n} greedy tokens per row")
    results, policy = {}, None
    for width in args.rows:
        if profile is None:
            prompts = [encode(lm.tokenizer, items[i % len(items)]) for i in range(width)]
            make = BatchSpeculator
        else:
            prompts = [random_prompt(args.context, seed=i) for i in range(width)]
            deepest = max(args.depths + ([TIMED_DEPTH] if args.policy else []))  # what a round may draft
            make, head = replayed(lm, prompts, n, deepest, profile, args.draft_vocab)
        methods = {f"batched depth {d}": (lambda d=d: batched_drafting(lm, prompts, n, DepthPolicy(None, [], pinned=d), make))
                   for d in args.depths}
        picked = {}  # depth -> rounds the policy ran at it, over the repeats
        if args.policy:
            policy = policy or server_policy(lm, prompts[0], args.rows, profile, head)
            methods["batched, the server's policy"] = lambda: batched_drafting(lm, prompts, n, policy, make, picked)
        methods["plain batched (mlx-lm BatchGenerator)"] = lambda: plain_batching(lm, prompts, n)
        if args.serial_depth and profile is None:
            methods[f"serial drafting depth {args.serial_depth}"] = lambda: serial_drafting(lm, prompts, n, args.serial_depth)
        names = list(methods)
        reference = None
        for name in names:  # warm up every shape once (compilation, the verify pass's first-use probe)
            out, _ = methods[name]()
            reference = reference or out
            assert out == reference, f"{name}: the greedy texts differ"
        rates = {name: [] for name in names}
        decode = {name: [] for name in names}  # tokens after each row's first over the time after
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                out, seconds, decoding = timed(methods[name])
                tokens = sum(len(t) for t in out.values())
                rates[name].append(tokens / seconds)
                if decoding is not None:
                    decode[name].append((tokens - len(out)) / decoding)
        plain = names.index("plain batched (mlx-lm BatchGenerator)")
        plain = names[plain]
        results[width] = {}
        print(f"\nB = {width} ({sum(len(t) for t in reference.values())} tokens); "
              "all: prefill included, decode: after every row's first token")
        for name in names:
            med = statistics.median(rates[name])
            ratio = statistics.median(a / b for a, b in zip(rates[name], rates[plain]))
            results[width][name] = {"tok_s": rates[name], "median": med, "vs_plain": ratio}
            line = (f"  {name:40} all {med:8.1f} tok/s  ({min(rates[name]):.1f}-{max(rates[name]):.1f})"
                    f"  x{ratio:.2f} of plain batched")
            if decode[name]:
                dec = statistics.median(decode[name])
                dratio = statistics.median(a / b for a, b in zip(decode[name], decode[plain]))
                results[width][name].update(decode_tok_s=decode[name], decode_median=dec, decode_vs_plain=dratio)
                line += f"; decode {dec:8.1f} tok/s  x{dratio:.2f}"
            print(line)
        if picked:
            results[width]["policy_rounds_by_depth"] = picked
            print(f"  the policy's rounds by depth: {dict(sorted(picked.items()))}")
    if args.json:
        record = {"command": " ".join(sys.argv), "label": label, "blas": detect().as_json(), "results": results}
        pathlib.Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
