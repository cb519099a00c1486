"""A/B of the speculative round: an earlier revision's engine against the working tree's, paired.

    python tools/ab_engine.py --before REV [--after REV] [--model assets/dyno-tiny] [--depths 1 3] [--temp 0]
                              [--suite code] [--prompts N] [--pairs 5] [--max-tokens 200] [--json FILE]

A change to the round is worth keeping only if it helps, or is neutral here and removes work a GPU
backend would wait on; this measures that. Each side is a whole tree: `--before REV` is checked out
with `git worktree add --detach` into a temporary folder (removed at the end, also when stopped),
`--after` likewise, else the working tree as it is. Each side runs in a child process of its own
(this file with `--child`, its cwd and PYTHONPATH at that tree) that loads the model once and then
runs one `engine.generate(lm, prompt, params, SpecConfig("mtp", depth))` per request (JSON lines on
its stdin and stdout), so any revision whose generate takes those arguments can be measured, before
the drafter seam or after it. A file in place of REV (an old engine.py) is no longer taken.

Per prompt and depth the two alternate (A B, then B A on the next pair, so neither always runs
second); each run's decode time per round is the time from first to last token over the rounds
between them. Reported: the median of the paired ratios after/before of the time per round
(min-max), the tokens per round of each (GenerationStats', pooled over its runs), and whether every
pair emitted the same tokens (greedy: it must; sampled with a seed: it does unless the head rows
round differently). The prompts are the suite's, encoded by the after side. The children inherit
the environment, so `tools/with_openblas.sh python tools/ab_engine.py ...` runs both with that BLAS.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- a side: a child process at one tree ----

def child(model: str) -> None:
    """Serve generations over stdin/stdout, one JSON line each way, with the tree on sys.path."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else the engine prints goes to stderr, not into the replies
    import speculative
    from speculative.config import SamplingParams, SpecConfig
    from speculative.engine import generate
    from speculative.events import Token
    from speculative.loader import load_checkpoint
    from speculative.measure.suites import SUITES, encode
    from speculative.stats import GenerationStats

    lm = load_checkpoint(model, mode="mtp")

    def answer(x) -> None:
        replies.write(json.dumps(x) + "\n")
        replies.flush()

    answer({"ready": speculative.__file__})
    for line in sys.stdin:
        ask = json.loads(line)
        if "suite" in ask:
            answer({"prompts": [encode(lm.tokenizer, item) for item in SUITES[ask["suite"]]]})
            continue
        n, temp = ask["max_tokens"], ask["temp"]
        params = (SamplingParams(max_tokens=n) if temp == 0 else
                  SamplingParams(temperature=temp, top_p=0.95, top_k=20, max_tokens=n, seed=ask["seed"]))
        times, stats = [], GenerationStats()
        for e in generate(lm, ask["prompt"], params, SpecConfig("mtp", ask["depth"])):
            stats.add(e)
            if isinstance(e, Token):
                times.append(time.perf_counter())
        # Rounds after the first token's prefill: all of them end between the first and last token.
        answer({"tokens": stats.tokens, "rounds": stats.rounds, "accepted": stats.accepted_tokens,
                "per_round": (times[-1] - times[0]) / max(stats.rounds, 1)})


class Side:
    """One tree's engine in its child process."""

    def __init__(self, tree: pathlib.Path, model: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        self.proc = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), "--child", "--model", model],
                                     cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            where = pathlib.Path(self._read()["ready"]).resolve()
            if tree.resolve() not in where.parents:  # another tree's package would make both sides one
                raise RuntimeError(f"the side at {tree} imported its engine from {where}")
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a side's process ended (exit status {self.proc.wait()}); its stderr says why")
        return json.loads(line)

    def ask(self, **request) -> dict:
        """Send one request, return the child's reply."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """End the child: its stdin closed (it leaves its loop), killed if it does not exit."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


@contextmanager
def checkout(rev: str):
    """A temporary worktree of git revision `rev`, removed on the way out."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="ab_engine-"))
    tree = folder / "tree"
    try:
        if subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev], cwd=ROOT).returncode:
            raise SystemExit(f"ab_engine: cannot check out {rev!r} (git says why above)")
        yield tree
    finally:
        if tree.exists():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def side(tree: pathlib.Path, model: str):
    """A Side at `tree`, ended on the way out."""
    started = Side(tree, model)
    try:
        yield started
    finally:
        started.close()


# ---- the pairs ----

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="git revision that is 'before'")
    ap.add_argument("--after", help="git revision that is 'after' (default: the working tree)")
    ap.add_argument("--model", default=str(ROOT / "assets" / "dyno-tiny"))
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--temp", type=float, default=0.0, help="0: greedy; else with top-p 0.95, top-k 20, seed 0")
    ap.add_argument("--suite", default="code", help="a suite of speculative/measure/suites.py")
    ap.add_argument("--prompts", type=int, default=0, help="the suite's first N prompts (0: all)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model)
        return
    if args.before is None:
        ap.error("--before is required")
    if pathlib.Path(args.before).is_file():
        ap.error("--before takes a git revision (an engine.py file is no longer taken)")
    sys.path.insert(0, str(ROOT))  # (the parent only: each child imports its own tree's package)
    from speculative.measure.suites import SUITES

    if args.suite not in SUITES:
        ap.error(f"--suite must be one of {', '.join(sorted(SUITES))}: {args.suite!r}")
    model = str(pathlib.Path(args.model).resolve())  # the children's cwd is their tree
    # A stopped run (kill, timeout) still removes its worktrees and children.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with ExitStack() as stack:
        before_tree = stack.enter_context(checkout(args.before))
        after_tree = stack.enter_context(checkout(args.after)) if args.after else ROOT
        sides = {"before": stack.enter_context(side(before_tree, model)),
                 "after": stack.enter_context(side(after_tree, model))}
        out = compare(sides, args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


def compare(sides: dict, args) -> dict:
    """The paired runs of every depth, printed and returned as the record."""
    import mlx.core as mx

    prompts = sides["after"].ask(suite=args.suite)["prompts"]
    prompts = prompts[: args.prompts] if args.prompts > 0 else prompts
    out = {"before": args.before, "after": args.after or "working tree", "model": args.model, "suite": args.suite,
           "temperature": args.temp, "pairs": args.pairs, "max_tokens": args.max_tokens,
           "device": str(mx.default_device()), "mlx": mx.__version__, "depths": []}
    print(f"before {args.before} vs {args.after or 'the working tree'}; {args.model}, suite {args.suite}, T={args.temp}, "
          f"{args.max_tokens} tokens, {args.pairs} pairs per prompt, {mx.default_device()}", flush=True)
    for k in args.depths:
        for s in sides.values():  # warm-up: allocation, first-use compiles and probes
            s.ask(prompt=prompts[0], depth=k, temp=0, seed=0, max_tokens=24)
        ratios, rows, same = [], {"before": [], "after": []}, True
        for i in range(args.pairs):
            for prompt in prompts:
                order = ["before", "after"][:: 1 if i % 2 == 0 else -1]
                got = {name: sides[name].ask(prompt=prompt, depth=k, temp=args.temp, seed=0, max_tokens=args.max_tokens)
                       for name in order}
                same &= got["before"]["tokens"] == got["after"]["tokens"]
                ratios.append(got["after"]["per_round"] / got["before"]["per_round"])
                for name in rows:
                    rows[name].append(got[name])
        r = {"depth": k, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
             "ratio_max": max(ratios), "identical": same,
             **{f"{name}_ms_per_round": statistics.median(x["per_round"] for x in v) * 1e3 for name, v in rows.items()},
             **{f"{name}_tokens_per_round": tokens_per_round(v) for name, v in rows.items()}}
        out["depths"].append(r)
        print(f"depth {k}: ms per round before {r['before_ms_per_round']:.2f}, after {r['after_ms_per_round']:.2f}; "
              f"after/before median {r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) over "
              f"{len(ratios)} pairs; tokens/round {r['before_tokens_per_round']:.2f} -> {r['after_tokens_per_round']:.2f}; "
              f"identical tokens: {'yes' if same else 'NO'}", flush=True)
    return out


def tokens_per_round(runs) -> float:
    """GenerationStats.tokens_per_round over every run's rounds pooled: 1 + accepted drafts / rounds."""
    rounds = sum(r["rounds"] for r in runs)
    return 1 + sum(r["accepted"] for r in runs) / rounds if rounds else float("nan")


if __name__ == "__main__":
    main()
