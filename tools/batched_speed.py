"""Aggregate tokens per second of B greedy requests at once: batched drafting against plain batching
(mlx-lm's BatchGenerator) and against serial single-row drafting.

    python tools/batched_speed.py [--model assets/dyno-tiny] [--rows 1 2 4] [--depths 1 2 3]
                                  [--max-tokens 128] [--repeats 5] [--serial-depth 3] [--json FILE]

Each run starts from the prompts (prefill included) and ends at the last row's last token; the
tokens are B x max_tokens unless a row reaches EOS (then the same for every method: greedy texts
are checked to be identical). Per width the methods run in a rotating order each repeat, so no
method always runs first; reported: the median aggregate tokens/s over the repeats (min-max) and,
for batched drafting, the median ratio to plain batching within the same repeat.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from speculative.batched import BatchSpeculator  # noqa: E402
from speculative.config import SamplingParams, SpecConfig  # noqa: E402
from speculative.engine import generate  # noqa: E402
from speculative.events import Token  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from speculative.measure.suites import SUITES, encode  # noqa: E402


def batched_drafting(lm, prompts, n, depth):
    """Rows join (each prefilled alone), then rounds at `depth` until every row is done."""
    batch, out = BatchSpeculator(lm), {}
    for i, p in enumerate(prompts):
        out[i] = [e.id for e in batch.join(i, p, SamplingParams(max_tokens=n)).events]
    while batch:
        for i, r in batch.step(depth).items():
            out[i] += [e.id for e in r.events if isinstance(e, Token)]
    return out


def plain_batching(lm, prompts, n):
    """mlx-lm's BatchGenerator with every row in one batch (what `--decode-concurrency` runs)."""
    gen = BatchGenerator(lm.model, stop_tokens=[[t] for t in lm.eos_token_ids],
                         completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    out, left = {u: [] for u in uids}, len(uids)
    while left:
        for r in gen.next_generated():
            out[r.uid].append(int(r.token))
            left -= r.finish_reason is not None
    gen.close()
    return {i: out[u] for i, u in enumerate(uids)}


def serial_drafting(lm, prompts, n, depth):
    """One request after another through the single-row speculator (today's default server)."""
    return {i: [e.id for e in generate(lm, p, SamplingParams(max_tokens=n), SpecConfig("mtp", depth))
                if isinstance(e, Token)] for i, p in enumerate(prompts)}


def timed(fn):
    mx.synchronize()
    start = time.perf_counter()
    out = fn()
    mx.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "assets" / "dyno-tiny"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--serial-depth", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_checkpoint(args.model)
    items = SUITES["code"] + SUITES["reasoning"]
    n = args.max_tokens
    print(f"MLX {mx.__version__}, {mx.default_device()}, {args.model}, {n} greedy tokens per row")
    results = {}
    for width in args.rows:
        prompts = [encode(lm.tokenizer, items[i % len(items)]) for i in range(width)]
        methods = {f"batched depth {d}": (lambda d=d: batched_drafting(lm, prompts, n, d)) for d in args.depths}
        methods["plain batched (mlx-lm BatchGenerator)"] = lambda: plain_batching(lm, prompts, n)
        methods[f"serial drafting depth {args.serial_depth}"] = lambda: serial_drafting(lm, prompts, n, args.serial_depth)
        names = list(methods)
        reference = None
        for name in names:  # warm up every shape once (compilation, the verify pass's first-use probe)
            out = methods[name]()
            reference = reference or out
            assert out == reference, f"{name}: the greedy texts differ"
        rates = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                out, seconds = timed(methods[name])
                rates[name].append(sum(len(t) for t in out.values()) / seconds)
        plain = rates[names[len(args.depths)]]
        results[width] = {}
        print(f"\nB = {width} ({sum(len(t) for t in reference.values())} tokens)")
        for name in names:
            med = statistics.median(rates[name])
            ratio = statistics.median(a / b for a, b in zip(rates[name], plain))
            results[width][name] = {"tok_s": rates[name], "median": med, "vs_plain": ratio}
            print(f"  {name:40} {med:8.1f} tok/s  ({min(rates[name]):.1f}-{max(rates[name]):.1f})"
                  f"  x{ratio:.2f} of plain batched")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
