"""What the MTP head's precision costs and saves: its bytes at 16, 8 and 4 bits, and the time of a
head step (the head alone, and the draft step: head + lm_head + argmax) on this machine's backend.

    python tools/head_precision.py [--model assets/dyno-tiny] [--reps 40]
    python tools/head_precision.py --linears-27b [--reps 10]
    python tools/head_precision.py --teacher-forced [--model assets/dyno-tiny]
    python tools/head_precision.py --records bench-16.json bench-8.json bench-4.json

Every time is a median of round-robin bursts (speculative.measure.bench's timing), all precisions taking
turns so that the machine's drift lands on all alike. Also prints the head's bytes at each
precision for the published 27B shapes (Qwen3.5/3.6/3.8-27B share them), by precision.planned_bytes'
arithmetic on their config values (tests/heads/test_head_precision.py checks it against a head module
built lazily with those shapes).

With --linears-27b it times one-row products with the 27B head's largest linear shapes (fc, the
MLP's gate/up and down) at each precision, on random bf16 weights (about 0.7 GB of memory).

With --teacher-forced it compares the heads on identical inputs: the code suite's prompts with
plain mlx-lm's 200-token continuation (greedy, and T=0.6/top-p 0.95/top-k 20 with seed 0, as
`dyno bench` samples), one trunk pass over each text, then at every generated position the
position-1 draft each head would make there. Greedy: the share of positions whose draft is the
trunk's argmax. T=0.6: the mean of sum(min(p, q)), the probability the lossless rule accepts a
draft drawn from q (the warped head distribution) against p (the warped trunk distribution).
Unlike `dyno bench`, whose sampled runs follow one trajectory each that the drafts themselves
steer, this has no sampling noise: the precisions differ only by their heads.

With --records (JSON records of `dyno bench --mtp-head-bits N`) it prints, per head precision,
temperature and depth, acceptance by position and tokens per round pooled over the suite's prompts
(their rounds and drafts in one GenerationStats), as Markdown table rows.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import mlx.core as mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from speculative.measure.cost_model import interleaved  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from speculative.heads.precision import HEAD_BITS, QWEN_27B, planned_bytes  # noqa: E402
from speculative.stats import GenerationStats  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/dyno-tiny")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--records", nargs="+", metavar="FILE", help="summarize these `dyno bench` JSON records instead")
    ap.add_argument("--linears-27b", action="store_true", help="time the 27B head's largest linear shapes instead")
    ap.add_argument("--teacher-forced", action="store_true", help="position-1 acceptance on identical texts instead")
    args = ap.parse_args()
    if args.records:
        return summarize(args.records)
    if args.linears_27b:
        return linears_27b(args.reps)
    if args.teacher_forced:
        return teacher_forced(args.model)

    models = {bits: load_checkpoint(args.model, mode="mtp", head_bits=bits) for bits in HEAD_BITS}
    lm = models[16]
    tokens = mx.array(lm.tokenizer.encode("def read_lines(path):\n    with open(path) as f:\n"))[None]
    hidden = lm.target.hidden(tokens, lm.target.make_cache())
    embed = lm.target.embed(tokens)
    builds = {}
    for bits, m in models.items():
        cache = m.head.make_cache()
        m.head(embed, hidden, cache)  # the prompt's rows, as after prefill
        mx.eval([c.state for c in cache])
        offset = cache[0].offset

        def head_only(m=m, cache=cache, offset=offset):
            out = m.head(embed[:, -1:], hidden[:, -1:], cache)
            cache[0].trim(cache[0].offset - offset)
            return out

        def draft(m=m, cache=cache, offset=offset):
            out = m.head(embed[:, -1:], hidden[:, -1:], cache)
            cache[0].trim(cache[0].offset - offset)
            return mx.argmax(m.target.lm_head(out[:, -1]), axis=-1)

        builds[("head", bits)] = head_only
        builds[("draft", bits)] = draft
    t = {key: v * 1e3 for key, v in interleaved(builds, args.reps).items()}
    print(f"{args.model} on {mx.default_device()}, MLX {mx.__version__}")
    print(f"{'bits':>4} {'head bytes':>11} {'head ms':>8} {'vs 16':>6} {'draft step ms':>14} {'vs 16':>6}")
    for bits, m in models.items():
        print(f"{bits:>4} {m.head_memory.bytes:>11,} {t[('head', bits)]:>8.3f} "
              f"{t[('head', bits)] / t[('head', 16)]:>5.2f}x {t[('draft', bits)]:>14.3f} "
              f"{t[('draft', bits)] / t[('draft', 16)]:>5.2f}x")
    print("Qwen3.5/3.6/3.8-27B head (bf16 checkpoint), in memory:")
    for bits in HEAD_BITS:
        n = planned_bytes(QWEN_27B, bits)
        print(f"  {bits:>2} bits: {n:,} bytes ({n / 1e9:.3f} GB)")


def linears_27b(reps: int) -> None:
    """One-row products with the 27B head's fc and MLP shapes, bf16 against 8- and 4-bit (group 64)."""
    import mlx.nn as nn

    from speculative.heads.precision import GROUP_SIZE

    h, i = QWEN_27B["hidden_size"], QWEN_27B["intermediate_size"]
    builds = {}
    for name, (out, inp) in {"fc": (h, 2 * h), "mlp.gate_proj": (i, h), "mlp.down_proj": (h, i)}.items():
        linear = nn.Linear(inp, out, bias=False)
        linear.set_dtype(mx.bfloat16)
        x = mx.random.normal((1, 1, inp)).astype(mx.bfloat16)
        layers = {16: linear, **{b: nn.QuantizedLinear.from_linear(linear, GROUP_SIZE, b) for b in (8, 4)}}
        mx.eval(x, [m.parameters() for m in layers.values()])
        for bits, m in layers.items():
            builds[(name, bits)] = lambda m=m, x=x: m(x)
    t = {key: v * 1e3 for key, v in interleaved(builds, reps).items()}
    print(f"27B head shapes, one row, on {mx.default_device()}, MLX {mx.__version__}")
    for name in dict.fromkeys(n for n, _ in t):
        print(f"  {name:14} " + "  ".join(f"{b}-bit {t[(name, b)]:7.2f} ms ({t[(name, b)] / t[(name, 16)]:.1f}x)"
                                          for b in HEAD_BITS))


def teacher_forced(model: str, max_tokens: int = 200) -> None:
    """Position-1 acceptance of each head precision at every generated position of the same texts."""
    from speculative.measure.suites import SUITES, encode
    from speculative.measure.bench import run_mlx_lm
    from speculative.config import SamplingParams
    from speculative.round.sampling import warp

    models = {bits: load_checkpoint(model, mode="mtp", head_bits=bits) for bits in HEAD_BITS}
    lm = models[16]
    print(f"{model} on {mx.default_device()}, MLX {mx.__version__}: position-1 acceptance, teacher-forced, "
          f"code suite")
    for temp in (0.0, 0.6):
        params = SamplingParams(temperature=temp, top_p=0.95 if temp else 1.0, top_k=20 if temp else 0,
                                max_tokens=max_tokens, seed=0)
        accepted, positions = {bits: 0.0 for bits in HEAD_BITS}, 0
        for item in SUITES["code"]:
            prompt = encode(lm.tokenizer, item)
            tokens = mx.array(prompt + run_mlx_lm(lm, prompt, params).tokens)[None]  # [1, T]
            hidden = lm.target.hidden(tokens, lm.target.make_cache())  # [1, T, H]
            n = len(prompt)
            target = lm.target.lm_head(hidden[0, n:-1])  # rows n..T-2: the trunk's next-token logits
            for bits, m in models.items():
                # head row p takes (t_{p+1}, h_p) and drafts t_{p+2}: rows n-1..T-3 meet trunk rows n..T-2
                g = m.head(m.target.embed(tokens[:, n:]), hidden[:, n - 1 : -1], m.head.make_cache())
                draft = m.target.lm_head(g[0, :-1])
                if temp == 0:
                    hits = mx.argmax(draft, axis=-1) == mx.argmax(target, axis=-1)
                else:
                    hits = mx.minimum(mx.exp(warp(draft, params)), mx.exp(warp(target, params))).sum(axis=-1)
                accepted[bits] += hits.astype(mx.float32).sum().item()
            positions += target.shape[0]
        base = accepted[16] / positions
        print(f"  T={temp:g} ({positions} positions): " + ", ".join(
            f"{models[b].head_memory.precision} {accepted[b] / positions:.4f} ({(accepted[b] / positions - base) * 100:+.2f} points)"
            for b in HEAD_BITS))


def summarize(paths) -> None:
    """Pooled acceptance by position and tokens per round per (head bits, temperature, depth)."""
    print("| head | T | depth | acceptance by position | tokens/round | vs plain mlx-lm, median of prompts |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        record = json.loads(pathlib.Path(path).read_text())
        head = record["mtp_head"]["precision"]
        pooled = {}
        for res in record["results"]:
            for s in res["settings"].values():
                if not s["depth"] or not s["drafted"]:
                    continue
                p = pooled.setdefault((res["temperature"], s["depth"]), {"stats": GenerationStats(), "ratios": []})
                p["stats"].merge(setting_counts(s))
                p["ratios"].append(s["ratio"]["median"])
        for (temp, depth), p in sorted(pooled.items()):
            acc = " ".join(f"{a:.3f}" for a in p["stats"].acceptance_by_position())
            ratio = sorted(p["ratios"])[len(p["ratios"]) // 2]
            print(f"| {head} | {temp:g} | {depth} | {acc} | {p['stats'].tokens_per_round:.2f} | {ratio:.2f}x |")


def setting_counts(s: dict) -> GenerationStats:
    """One bench setting's round counts; records without them (older `dyno bench`) give their rounds as
    drafted / depth (every round drafts `depth` tokens) and accepted drafts per position as rates."""
    if "rounds" in s:
        return GenerationStats.from_counts(s["rounds"], s["accepted_per_position"], s["drafted_per_position"])
    rounds = round(s["drafted"] / s["depth"])
    return GenerationStats.from_counts(rounds, [round(f * rounds) for f in s["acceptance_by_position"]],
                                       [rounds] * s["depth"])


if __name__ == "__main__":
    main()
