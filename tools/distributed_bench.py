"""Decode speed of Dyno on a model split across ranks, against mlx-lm's plain decoding of the same split.

Run every rank with mlx.launch, e.g. two ranks on this machine:

    mlx.launch --backend ring --hosts 127.0.0.1 -n 2 .venv/bin/python tools/distributed_bench.py \\
        --model assets/dyno-tiny --strategy pipeline --depths 1 2 3 --pairs 5 --out bench.json

Protocol (as speculative/measure/bench.py): one warm-up cycle, then `--pairs` cycles alternating plain
mlx-lm (its sharded_load + generate_step) with each Dyno setting, greedy; each Dyno run is compared
with the plain run of its cycle; medians with min-max; decode speed excludes the prefill.
Settings: `mtp@k` is Dyno as shipped (the head on every rank); `one-rank@k` drafts on rank 0 only
(a drafter, OneRankHead) and sends its drafts to the other ranks, one more collective per round (the
alternative the design rejected). Also measured: the cost model on the split model (T1 includes the hops) and the
latency of one small collective here. `project` adds a real link's latency per hop to the measured
step and round times, labelled as a projection. Rank 0 prints a summary and writes the JSON.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.utils import sharded_load  # noqa: E402

from speculative import distributed  # noqa: E402
from speculative.config import SamplingParams  # noqa: E402
from speculative.measure.cost_model import cost_model  # noqa: E402
from speculative.config import SpecConfig  # noqa: E402
from speculative.engine import generate  # noqa: E402
from speculative.events import Token  # noqa: E402
from speculative.round.drafter import Drafts, HeadDrafter  # noqa: E402
from speculative.stats import GenerationStats  # noqa: E402

PROMPT = ('import os\nimport sys\n\n\ndef list_files(root, suffix=".py"):\n'
          '    """Return the paths under root that end with suffix, sorted."""\n')


class OneRankHead(HeadDrafter):
    """The drafts made on rank 0 only: the other ranks receive them (an all_sum) before verifying.
    Greedy rows only (no draft distribution is sent). The head's rows after each round still run on
    every rank: the driver keeps each rank's head cache, which settling a request reads."""

    def __init__(self, ranks):
        super().__init__()
        self.ranks = ranks

    def propose(self, rounds, budgets):
        k = max(budgets)
        if self.ranks.rank == 0:
            drafts = super().propose(rounds, budgets).tokens
        else:
            drafts = mx.zeros((len(budgets), k), mx.uint32)
        tokens = mx.distributed.all_sum(drafts.astype(mx.int32), group=self.ranks.group).astype(mx.uint32)
        return Drafts(tokens, [None] * len(budgets), list(budgets))


def _tps(times):
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def plain_run(model, prompt, n):
    """mlx-lm's greedy generate_step on the split model: (tokens, decode tok/s)."""
    tokens, times = [], []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        times.append(time.perf_counter())
        tokens.append(int(t))
    distributed._settle()  # its step in flight would race the next run's collectives
    return tokens, _tps(times)


def dyno_run(drafter, lm, prompt, n, depth):
    """Greedy Dyno on every rank in lockstep, drafting by `drafter(lm)` (None: the head on every
    rank): (tokens, decode tok/s, its GenerationStats)."""
    stats, times = GenerationStats(), []
    made = drafter(lm) if drafter is not None else None
    steps = generate(lm, prompt, SamplingParams(max_tokens=n), SpecConfig("mtp", depth), drafter=made)
    for e in steps:
        stats.add(e)
        if isinstance(e, Token):
            times.append(time.perf_counter())
            if len(stats.tokens) == n:
                break
    steps.close()
    return stats.tokens, _tps(times), stats


def collective_latency(group, n: int = 200) -> float:
    """Seconds for one tiny all_sum, evaluated alone (what a round's agreement costs here)."""
    x = mx.array([1], dtype=mx.int32)
    mx.eval(mx.distributed.all_sum(x, group=group))
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return (time.perf_counter() - start) / n


def hops(strategy: str, ranks: int, layers: int, untied: bool) -> int:
    """Link latencies on a 1-token forward's critical path, one per collective step: pipeline,
    a send per stage boundary and mlx-lm's all_gather of the output (ranks - 1 steps); tensor, two
    all-sums per layer (attention or GDN output, MLP output), 2 (ranks - 1) steps each on a ring,
    and the lm_head's all_gather when it is untied."""
    if strategy == "pipeline":
        return 2 * (ranks - 1)
    return 2 * layers * 2 * (ranks - 1) + (ranks - 1 if untied else 0)


def project(t1: float, round_s: float, tokens_per_round: float, forward_hops: int, agree_hops: int,
            link_s: float) -> dict:
    """PROJECTION, not a measurement: decode tok/s of plain and Dyno when every hop also costs a
    real link's latency `link_s`, added to what was measured here. A plain step (T1) and a Dyno
    round's verify pass each cross forward_hops links; the round also its agreement's (agree_hops);
    the head steps stay on the rank. Bandwidth is left out: a decode step sends a few hidden rows."""
    plain = 1 / (t1 + forward_hops * link_s)
    dyno = tokens_per_round / (round_s + (forward_hops + agree_hops) * link_s)
    return {"link_us": link_s * 1e6, "plain_tps": plain, "dyno_tps": dyno, "speedup": dyno / plain}


def summarize(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assets/dyno-tiny")
    ap.add_argument("--strategy", choices=distributed.STRATEGIES, default="pipeline")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15, help="cost model repetitions")
    ap.add_argument("--links-us", type=float, nargs="+", default=[10, 50, 100, 200, 500, 1000],
                    help="per-hop link latencies to project, in microseconds")
    ap.add_argument("--out")
    args = ap.parse_args()

    group = distributed.init_group("any", 60)
    rank = group.rank()
    lm = distributed.load_sharded(args.model, args.strategy, group, mode="mtp")
    split = {"pipeline_group" if args.strategy == "pipeline" else "tensor_group": group}
    plain_model, _ = sharded_load(args.model, **split)
    prompt = lm.tokenizer.encode(PROMPT)
    n = args.max_tokens
    settings = {f"mtp@{k}": (None, k) for k in args.depths}
    settings.update({f"one-rank@{k}": (lambda lm: OneRankHead(lm.ranks), k) for k in args.depths})

    plain_run(plain_model, prompt, n)  # warm-up
    for drafter, k in settings.values():
        dyno_run(drafter, lm, prompt, n, k)
    base, runs = [], {name: {"tps": [], "ratio": [], "stats": GenerationStats(), "identical": True} for name in settings}
    for _ in range(args.pairs):
        ref, tps = plain_run(plain_model, prompt, n)
        base.append(tps)
        for name, (drafter, k) in settings.items():
            tokens, d_tps, stats = dyno_run(drafter, lm, prompt, n, k)
            r = runs[name]
            r["tps"].append(d_tps)
            r["ratio"].append(d_tps / tps)
            r["stats"].merge(stats)
            r["identical"] &= tokens == ref

    costs = cost_model(lm, prompt, args.depths, reps=args.reps)
    local = collective_latency(group)
    text = lm.text_config
    forward = hops(args.strategy, group.size(), text["num_hidden_layers"], not text.get("tie_word_embeddings", True))
    agree = group.size() - 1  # one all_gather of a few ints
    report = {
        "command": " ".join(sys.argv), "model": args.model, "strategy": args.strategy, "ranks": group.size(),
        "max_tokens": n, "pairs": args.pairs, "device": str(mx.default_device()),
        "load_average": os.getloadavg(), "cpus": os.cpu_count(),
        "plain_tps": summarize(base),
        "settings": {name: {"decode_tps": summarize(r["tps"]), "ratio": summarize(r["ratio"]),
                            "tokens_per_round": r["stats"].tokens_per_round,
                            "acceptance_by_position": r["stats"].acceptance_by_position(),
                            "identical": r["identical"]}
                     for name, r in runs.items()},
        "cost_model": {"T1_ms": costs["T1"] * 1e3, "Td_ms": costs["Td"] * 1e3,
                       "Tv_ms": {str(k): v * 1e3 for k, v in costs["Tv"].items()}},
        "collective_us": local * 1e6, "forward_hops": forward, "agree_hops": agree,
    }
    # From the paired medians: T1 = 1 / plain tok/s, a round = tokens per round / Dyno tok/s. The
    # same times under both splits' hop counts: the tensor rows say what this compute would give
    # with collectives in every layer (this model's heads do not split evenly, so it was not run).
    layers, untied = text["num_hidden_layers"], not text.get("tie_word_embeddings", True)
    t1 = 1 / report["plain_tps"]["median"]
    report["projection"] = {
        strategy: {"forward_hops": hops(strategy, group.size(), layers, untied), "by_depth": {
            str(k): [project(t1, s["tokens_per_round"] / s["decode_tps"]["median"], s["tokens_per_round"],
                             hops(strategy, group.size(), layers, untied), agree, us * 1e-6)
                     for us in args.links_us]
            for k in args.depths for s in [report["settings"][f"mtp@{k}"]]}}
        for strategy in distributed.STRATEGIES}
    if rank == 0:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        _print(report)
    return 0


def _print(r: dict) -> None:
    p = r["plain_tps"]
    print(f"{r['model']} split by {r['strategy']} over {r['ranks']} ranks ({r['device']}), {r['max_tokens']} tokens, "
          f"{r['pairs']} pairs")
    print(f"plain mlx-lm: {p['median']:.1f} tok/s ({p['min']:.1f}-{p['max']:.1f})")
    for name, s in r["settings"].items():
        d, q = s["decode_tps"], s["ratio"]
        print(f"{name:12s} {d['median']:7.1f} tok/s  x{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})  "
              f"{s['tokens_per_round']:.2f} tok/round  identical={s['identical']}")
    c = r["cost_model"]
    print(f"cost model (measured, split model): T1 {c['T1_ms']:.2f} ms, Td {c['Td_ms']:.2f} ms, "
          + ", ".join(f"Tv({k}) {v:.2f} ms" for k, v in c["Tv_ms"].items()))
    print(f"one small collective here: {r['collective_us']:.0f} us; hops per forward {r['forward_hops']}, "
          f"per agreement {r['agree_hops']}")
    print(f"load average {', '.join(f'{x:.1f}' for x in r['load_average'])} on {r['cpus']} CPUs")
    print("PROJECTION (not measured): Dyno's speedup over plain when every hop adds a link's latency")
    for strategy, p in r["projection"].items():
        label = "measured split" if strategy == r["strategy"] else "same times, its hop count"
        print(f"  {strategy} ({p['forward_hops']} hops per forward; {label}):")
        for k, rows in p["by_depth"].items():
            print(f"    depth {k}: " + ", ".join(f"{row['link_us']:g} us x{row['speedup']:.2f}" for row in rows))


if __name__ == "__main__":
    sys.exit(main())
