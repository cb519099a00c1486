"""A/B of the speculative round: an earlier revision's engine against the working tree's, paired.

    python tools/ab_engine.py --before REV|FILE [--after REV|FILE] [--model assets/dyno-tiny] [--depths 1 3] [--temp 0]
                              [--suite code] [--pairs 5] [--max-tokens 200] [--json FILE]

A change to the round is worth keeping only if it helps, or is neutral here and removes work a GPU
backend would wait on; this measures that. `speculative/engine.py` at REV (`git show`) is loaded
as a sibling module of the current package (its relative imports resolve to today's cache,
verify, sampling...), and its Speculator is today's `engine.generate`'s `runner=`, so the two
differ only in the runner. Per prompt and depth the two alternate (A B, then B A on the next pair,
so neither always runs second); each run's decode time per round is the time from first to last
token over the rounds between them. Reported: the median of the paired ratios after/before of the
time per round (min-max), the tokens per round of each (GenerationStats', pooled over its runs), and
whether every pair emitted the same tokens (greedy: it must; sampled with a seed: it does unless the
head rows round differently).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import mlx.core as mx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from speculative import engine  # noqa: E402
from speculative.config import SamplingParams, SpecConfig  # noqa: E402
from speculative.events import Token  # noqa: E402
from speculative.stats import GenerationStats  # noqa: E402


def engine_at(rev: str, name: str):
    """speculative/engine.py as of git revision `rev` (or the engine file at path `rev`), loaded as
    speculative._engine_<name> so that its relative imports resolve to today's package."""
    if pathlib.Path(rev).is_file():
        source = pathlib.Path(rev).read_text()
    else:
        source = subprocess.run(["git", "show", f"{rev}:speculative/engine.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / f"engine_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"speculative._engine_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def runner(cls):
    """engine.generate's `runner=` for a Speculator class of either revision."""
    return lambda lm, params, spec, prefill_step: cls(lm, params, spec.draft_depth, prefill_step, spec.draft_vocab)


def timed(lm, prompt, params, depth: int, cls) -> dict:
    """One generation: tokens, its GenerationStats, and seconds per round from the first token to the last."""
    times, stats = [], GenerationStats()
    for e in engine.generate(lm, prompt, params, SpecConfig("mtp", depth), runner=runner(cls)):
        stats.add(e)
        if isinstance(e, Token):
            times.append(time.perf_counter())
    # Rounds after the first token's prefill: all of them end between the first and last token.
    return {"tokens": stats.tokens, "stats": stats, "per_round": (times[-1] - times[0]) / max(stats.rounds, 1)}


def pooled(runs) -> GenerationStats:
    """Every run's rounds in one GenerationStats."""
    total = GenerationStats()
    for stats in runs:
        total.merge(stats)
    return total


def main() -> None:
    from speculative.loader import load_checkpoint
    from speculative.measure.suites import SUITES, encode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision (or engine.py file) that is 'before'")
    ap.add_argument("--after", help="git revision (or engine.py file) that is 'after' (default: the working tree)")
    ap.add_argument("--model", default=str(ROOT / "assets" / "dyno-tiny"))
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--temp", type=float, default=0.0, help="0: greedy; else with top-p 0.95, top-k 20, seed 0")
    ap.add_argument("--suite", default="code", choices=sorted(SUITES))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    before = engine_at(args.before, "before").Speculator
    after = engine_at(args.after, "after").Speculator if args.after else engine.Speculator
    lm = load_checkpoint(args.model, mode="mtp")
    prompts = [encode(lm.tokenizer, item) for item in SUITES[args.suite]]
    params = (SamplingParams(max_tokens=args.max_tokens) if args.temp == 0 else
              SamplingParams(temperature=args.temp, top_p=0.95, top_k=20, max_tokens=args.max_tokens, seed=0))
    out = {"before": args.before, "after": args.after or "working tree", "model": args.model, "suite": args.suite,
           "temperature": args.temp, "pairs": args.pairs, "max_tokens": args.max_tokens,
           "device": str(mx.default_device()), "mlx": mx.__version__, "depths": []}
    print(f"before {args.before} vs {args.after or 'the working tree'}; {args.model}, suite {args.suite}, T={args.temp}, "
          f"{args.max_tokens} tokens, {args.pairs} pairs per prompt, {mx.default_device()}")
    for k in args.depths:
        for cls in (before, after):  # warm-up: allocation, first-use compiles and probes
            timed(lm, prompts[0], SamplingParams(max_tokens=24), k, cls)
        ratios, rows, same = [], {"before": [], "after": []}, True
        for i in range(args.pairs):
            for prompt in prompts:
                order = [("before", before), ("after", after)][:: 1 if i % 2 == 0 else -1]
                got = {name: timed(lm, prompt, params, k, cls) for name, cls in order}
                same &= got["before"]["tokens"] == got["after"]["tokens"]
                ratios.append(got["after"]["per_round"] / got["before"]["per_round"])
                for name in rows:
                    rows[name].append(got[name])
        r = {"depth": k, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
             "ratio_max": max(ratios), "identical": same,
             **{f"{name}_ms_per_round": statistics.median(x["per_round"] for x in v) * 1e3 for name, v in rows.items()},
             **{f"{name}_tokens_per_round": pooled(x["stats"] for x in v).tokens_per_round for name, v in rows.items()}}
        out["depths"].append(r)
        print(f"depth {k}: ms per round before {r['before_ms_per_round']:.2f}, after {r['after_ms_per_round']:.2f}; "
              f"after/before median {r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) over "
              f"{len(ratios)} pairs; tokens/round {r['before_tokens_per_round']:.2f} -> {r['after_tokens_per_round']:.2f}; "
              f"identical tokens: {'yes' if same else 'NO'}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
