"""What a draft vocabulary of N tokens costs and saves on this machine: teacher-forced coverage and
position-1 acceptance by ranking and N, and the time of one draft step by N.

    python tools/draft_vocab.py --rankings [--model assets/dyno-tiny] [--budgets 32,256] [--text FILE ...]
    python tools/draft_vocab.py --td [--model assets/dyno-tiny] [--reps 60] [--sizes 256,512,1024,1536,2048,3072]
    python tools/draft_vocab.py --projection-27b
    python tools/draft_vocab.py --ship [--model assets/dyno-tiny]

--rankings compares the tokenizer's id (merge) order with the counted ranking (speculative/draft_vocab/rank.py:
the softmax mass of the model's own T=1 continuations of vocab_rank's seeds, derived here afresh with
--budgets tokens per seed; the seeds are not the evaluation prompts). The texts: every `dyno bench`
suite prompt with plain mlx-lm's 200-token continuation, greedy and T=0.6/top-p 0.95/top-k 20 (seed
0, as `dyno bench` samples), and the --text files' first 1200 tokens each (pooled). One trunk pass over each text,
then at every continuation position: coverage, the share of positions whose emitted token (greedy:
the trunk's argmax; sampled: the sampled token) is in the subset; acceptance, the head's position-1
draft scored against the trunk with the draft restricted to the subset (greedy: its argmax over the
subset is the trunk's argmax; T=0.6: sum(min(p, q)), q the warped head distribution over the subset).
`auto` is the N that draft_vocab.auto_size picks from the counted ranking.

--td times one draft step (head + projection + greedy pick) with the full lm_head, and for each N
through DraftLMHead's full-width row, then argmax (what sampled and processed drafts need), and with
DraftLMHead.greedy (argmax over the subset, mapped through its ids): medians of round-robin bursts
(speculative.measure.cost_model.interleaved), every variant taking turns so that the machine's drift lands
on all alike.

--projection-27b prints, by arithmetic on the published Qwen3.5/3.6/3.8-27B config values (vocabulary
248,320, hidden 5,120; precision.QWEN_27B), the bytes one draft step reads: the head layer at each
precision (precision.planned_bytes) and the lm_head at 4 bits (group 64, bf16 scales and biases), whole
or the subset `auto` keeps at least (AUTO_MIN_SHARE), and what that would make of a 1.5 ms draft step
and the cost model's bound (E = 3.5, three drafts, Tv(3) = 1.33 T1, T1 = 30 ms: measuring.md's
Apple Silicon figures) if Td followed the bytes read and acceptance held. A projection, not a measurement.

--ship derives the model's ranking (vocab_rank.derive) and writes it into the model folder as
draft_vocab.safetensors, where Dyno looks first (the bundled dyno-tiny ships its own).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from speculative.draft_vocab import rank as vocab_rank  # noqa: E402
from speculative.measure.cost_model import interleaved  # noqa: E402
from speculative.draft_vocab.head import DraftLMHead, auto_size, lm_head_module, ranked_ids  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402

SIZES = (256, 512, 1024, 1536, 2048, 3072)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/dyno-tiny")
    ap.add_argument("--rankings", action="store_true", help="teacher-forced coverage and acceptance by ranking and N")
    ap.add_argument("--td", action="store_true", help="time one draft step by N")
    ap.add_argument("--budgets", default=str(vocab_rank.TOKENS_PER_SEED), help="tokens per seed of the counted rankings")
    ap.add_argument("--text", nargs="*", default=[], metavar="FILE", help="more texts to score (first 1200 tokens)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--projection-27b", action="store_true", help="bytes per draft step on a 27B model, projected")
    ap.add_argument("--ship", action="store_true", help="write the model's ranking into its folder")
    args = ap.parse_args()
    if args.projection_27b:
        return projection_27b()
    lm = load_checkpoint(args.model, mode="mtp")
    if args.ship:
        order, mass = vocab_rank.derive(lm.model, vocab_rank.seed_prompts(lm.tokenizer), lm.target.args.vocab_size,
                                        sorted(lm.eos_token_ids))
        vocab_rank.save(lm.path / vocab_rank.FILE, order, mass)
        return print(f"wrote {lm.path / vocab_rank.FILE}")
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{args.model} (vocabulary {lm.target.args.vocab_size}, hidden {lm.target.args.hidden_size}) on "
          f"{mx.default_device()}, MLX {mx.__version__}")
    if args.rankings:
        rankings(lm, sizes, [int(b) for b in args.budgets.split(",")], args.text)
    if args.td:
        td(lm, sizes, args.reps)


def texts(lm, extra):
    """{name: [(prompt ids, continuation ids)]}: the suites' plain continuations, and the --text files."""
    from speculative.measure.bench import run_mlx_lm
    from speculative.config import SamplingParams
    from speculative.measure.suites import SUITES, encode

    out = {}
    for temp in (0.0, 0.6):
        params = SamplingParams(temperature=temp, top_p=0.95 if temp else 1.0, top_k=20 if temp else 0,
                                max_tokens=200, seed=0)
        out[f"suites T={temp:g}"] = [(p, run_mlx_lm(lm, p, params).tokens)
                                     for items in SUITES.values() for p in (encode(lm.tokenizer, i) for i in items)]
    for path in extra:
        ids = lm.tokenizer.encode(pathlib.Path(path).read_text())[:1201]
        out.setdefault(f"{len(extra)} --text files", []).append((ids[:1], ids[1:]))
    return out


def scored_rows(lm, prompt, continuation):
    """(trunk logits [P, V], head draft logits [P, V], emitted tokens [P]) at each continuation position."""
    tokens = mx.array(prompt + continuation)[None]
    n = len(prompt)
    hidden = lm.target.hidden(tokens, lm.target.make_cache())
    target = lm.target.lm_head(hidden[0, n:-1])  # the trunk's next-token logits, rows n..T-2
    # head row p takes (t_{p+1}, h_p) and drafts t_{p+2}: rows n-1..T-3 meet trunk rows n..T-2
    g = lm.head(lm.target.embed(tokens[:, n:]), hidden[:, n - 1:-1], lm.head.make_cache())
    draft = lm.target.lm_head(g[0, :-1])
    return target.astype(mx.float32), draft.astype(mx.float32), np.array(continuation[1:])


def rankings(lm, sizes, budgets, extra) -> None:
    from speculative.config import SamplingParams
    from speculative.round.sampling import warp

    vocab = lm.target.args.vocab_size
    orders = {"ids": vocab_rank.id_order(vocab)}
    seeds = vocab_rank.seed_prompts(lm.tokenizer)
    for b in budgets:
        order, mass = vocab_rank.derive(lm.model, seeds, vocab, sorted(lm.eos_token_ids), tokens=b)
        orders[f"counted ({len(seeds)}x{b})"] = vocab_rank.Ranking(order, mass, "derived")
    counted = list(orders.values())[-1]
    auto = auto_size(counted, vocab)
    sizes = sorted(set(sizes) | ({auto} if auto else set()))  # and the N auto picks
    print(f"auto (last counted ranking, {counted.mass.sum():.0f} positions): {auto or 'full'}; counted mass on the first N: " +
          ", ".join(f"{n}: {counted.covered(n):.3f}" for n in sizes))
    subsets = {(name, n): np.array(ranked_ids(lm.tokenizer, vocab, n, r.order)) for name, r in orders.items()
               for n in sizes}
    masks = {key: mx.array(np.isin(np.arange(vocab), ids)) for key, ids in subsets.items()}
    params = SamplingParams(temperature=0.6, top_p=0.95, top_k=20)
    for label, items in texts(lm, extra).items():
        sampled = "T=0.6" in label
        hits = {key: [0.0, 0.0] for key in subsets}
        full, positions = 0.0, 0
        for prompt, continuation in items:
            target, draft, emitted = scored_rows(lm, prompt, continuation)
            if not sampled:
                emitted = np.array(mx.argmax(target, axis=-1))
            p = mx.exp(warp(target, params)) if sampled else None
            full += accepted(draft, target, p, params)
            positions += len(emitted)
            for key, ids in subsets.items():
                restricted = mx.where(masks[key], draft, -mx.inf)  # what the draft head's row holds
                hits[key][0] += np.isin(emitted, ids).sum()
                hits[key][1] += accepted(restricted, target, p, params)
        print(f"\n{label}: {positions} positions, full vocabulary acceptance {full / positions:.4f}")
        print("| ranking | " + " | ".join(f"N={n}" for n in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for name in orders:
            print(f"| {name} | " + " | ".join(
                f"{hits[(name, n)][0] / positions:.3f} / {hits[(name, n)][1] / positions:.3f} "
                f"({(hits[(name, n)][1] - full) / positions * 100:+.1f})" for n in sizes) + " |")
    print("\ncells: coverage / position-1 acceptance (points against the full vocabulary)")


def accepted(draft, target, p, params) -> float:
    """Summed position-1 acceptance of `draft` rows against the trunk's: greedy when p is None."""
    from speculative.round.sampling import warp

    if p is None:
        return (mx.argmax(draft, axis=-1) == mx.argmax(target, axis=-1)).astype(mx.float32).sum().item()
    return mx.minimum(mx.exp(warp(draft, params)), p).sum().item()


def td(lm, sizes, reps) -> None:
    """Median ms of one draft step: full lm_head, and per N the scattered row or the direct greedy pick."""
    vocab = lm.target.args.vocab_size
    order = vocab_rank.ranking(lm, print).order
    tokens = mx.array(lm.tokenizer.encode("def read_lines(path):\n    with open(path) as f:\n"))[None]
    hidden = lm.target.hidden(tokens, lm.target.make_cache())
    embed = lm.target.embed(tokens)
    cache = lm.head.make_cache()
    lm.head(embed, hidden, cache)  # the prompt's rows, as after prefill
    mx.eval([c.state for c in cache])
    offset = cache[0].offset

    def head():
        out = lm.head(embed[:, -1:], hidden[:, -1:], cache)
        cache[0].trim(cache[0].offset - offset)
        return out[:, -1]

    builds = {("full", "lm_head + argmax"): lambda: mx.argmax(lm.target.lm_head(head()), axis=-1)}
    # (greedy_token on the whole lm_head is this same argmax)
    for n in sizes:
        d = DraftLMHead(lm_head_module(lm.target), ranked_ids(lm.tokenizer, vocab, n, order), vocab)
        builds[(n, "row + argmax")] = lambda d=d: mx.argmax(d(head()), axis=-1)
        builds[(n, "greedy")] = lambda d=d: d.greedy(head())
    t = {key: v * 1e3 for key, v in interleaved(builds, reps).items()}
    base = t[("full", "lm_head + argmax")]
    print(f"one draft step (head + projection + pick), median of {reps} round-robin bursts")
    print("| N | row + argmax | greedy |")
    print("|---|---|---|")
    print(f"| full | {base:.3f} ms | |")
    for n in sizes:
        a, g = t[(n, "row + argmax")], t[(n, "greedy")]
        print(f"| {n} | {a:.3f} ms ({(a / base - 1) * 100:+.0f}%) | {g:.3f} ms ({(g / base - 1) * 100:+.0f}%) |")


def projection_27b(td_ms: float = 1.5, e: float = 3.5, k: int = 3, tv_over_t1: float = 1.33, t1_ms: float = 30.0):
    """Bytes per draft step on Qwen3.5/3.6/3.8-27B, whole lm_head against auto's smallest subset."""
    import math

    from speculative.draft_vocab.head import AUTO_MIN_SHARE, AUTO_STEP
    from speculative.heads.precision import HEAD_BITS, QWEN_27B, _linear_bytes, planned_bytes

    v, h = QWEN_27B["vocab_size"], QWEN_27B["hidden_size"]
    n = math.ceil(AUTO_MIN_SHARE * v / AUTO_STEP) * AUTO_STEP
    rows = {"full": v, f"auto floor {n:,}": n}
    lm_head = {name: _linear_bytes(r, h, 4, 64, 2) for name, r in rows.items()}
    print(f"Qwen3.5/3.6/3.8-27B, lm_head [{v:,}, {h:,}] at 4 bits, group 64: " +
          ", ".join(f"{name} {b / 1e9:.3f} GB" for name, b in lm_head.items()))
    print("| head precision | head layer | draft step, whole lm_head | draft step, auto's floor | change |")
    print("|---|---|---|---|---|")
    step = {}
    for bits in HEAD_BITS:
        head = planned_bytes(QWEN_27B, bits)
        step[bits] = full, sub = head + lm_head["full"], head + list(lm_head.values())[1]
        print(f"| {bits if bits != 16 else 'bf16'}{'-bit' if bits != 16 else ''} | {head / 1e9:.3f} GB | "
              f"{full / 1e9:.3f} GB | {sub / 1e9:.3f} GB | {(sub / full - 1) * 100:+.0f}% |")
    full, sub = step[8]  # the head Dyno keeps beside a quantized trunk on Metal (docs/heads.md, Head memory)
    td = td_ms * sub / full
    bound = lambda t: e / (tv_over_t1 + k * t / t1_ms)  # noqa: E731
    print(f"8-bit head, Td {td_ms} ms with the whole lm_head, if it follows the bytes: {td:.2f} ms; "
          f"bound at E={e}, k={k}, Tv={tv_over_t1} T1, T1={t1_ms:g} ms: {bound(td_ms):.2f}x -> {bound(td):.2f}x")


if __name__ == "__main__":
    main()
