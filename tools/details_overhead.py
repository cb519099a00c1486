"""What the playground's details switch costs: tokens per second with SpecConfig.details on and off, paired.

    python tools/details_overhead.py [--model assets/dyno-tiny] [--depth 3] [--pairs 9] [--max-tokens 200] [--temp 0]
                                     [--per-round]

Details add one device-to-host copy per round (each draft's p, q and acceptance chance). Each pair
runs the same prompt both ways, alternating which goes first (the CPU may be shared), and times the
decode (first to last token); reported: the median of the paired ratios on/off of tokens per second
with their min-max, and whether every pair emitted the same tokens (it must: details change nothing).

On a shared CPU whole runs drift by tens of percent; `--per-round` pairs finer: one generation per
prompt switches details on and off every other round (its drafter, Alternating, sets the row's
details as it drafts each round), times each round (from its drafts to the next round's), and
reports the ratio of the median round time on/off, which is the tokens-per-second cost (the tokens
per round do not change).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from speculative.config import SamplingParams, SpecConfig  # noqa: E402
from speculative.engine import generate  # noqa: E402
from speculative.events import Token  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from speculative.round.drafter import HeadDrafter  # noqa: E402

PROMPTS = ['def read_lines(path):\n    """Return the lines of the file at path."""\n',
           "import os\n\n\ndef walk_files(root):\n", "class Stack:\n    def __init__(self):\n"]


def run(lm, prompt, params, depth, details):
    """(token ids, decode tokens per second) of one generation."""
    times, ids = [], []
    for e in generate(lm, prompt, params, SpecConfig("mtp", depth, details=details)):
        if isinstance(e, Token):
            times.append(time.perf_counter())
            ids.append(e.id)
    return ids, (len(times) - 1) / (times[-1] - times[0])


class Alternating(HeadDrafter):
    """The MTP head's drafts, with details on for every other round; each round timed, by setting.

    A round runs from its drafts (asked for at the end of the round before) to the next round's, so
    its details are switched as its drafts are asked for, before it verifies."""

    def __init__(self):
        super().__init__()
        self.times = {False: [], True: []}
        self._open = None  # (the round's start, its setting)

    def propose(self, rounds, budgets):
        now = time.perf_counter()
        if self._open is not None:
            start, details = self._open
            self.times[details].append(now - start)
        details = len(self.times[False]) > len(self.times[True])
        rounds.rows[0].details = details  # read by the round's verify (Rounds.verify_round)
        self._open = (now, details)
        return super().propose(rounds, budgets)


def per_round(lm, params, depth, prompts, repeats: int) -> None:
    times = {False: [], True: []}
    for n in range(repeats):
        for prompt in prompts:
            drafter = Alternating()
            for _ in generate(lm, lm.tokenizer.encode(prompt), params, SpecConfig("mtp", depth), drafter=drafter):
                pass
            for k in times:
                times[k] += drafter.times[k]
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"median round: off {off * 1e3:.3f} ms ({len(times[False])} rounds), on {on * 1e3:.3f} ms "
          f"({len(times[True])} rounds); details on/off tokens per second: {off / on:.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "assets" / "dyno-tiny"))
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--per-round", action="store_true", help="alternate details round by round in one generation")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.max_tokens < 2:
        ap.error("--pairs must be >= 1 and --max-tokens >= 2")
    lm = load_checkpoint(pathlib.Path(args.model))
    params = SamplingParams(temperature=args.temp, max_tokens=args.max_tokens, seed=0)
    for prompt in PROMPTS:  # warm-up: compiled graphs and caches for both settings
        for details in (False, True):
            run(lm, lm.tokenizer.encode(prompt), params, args.depth, details)
    if args.per_round:
        per_round(lm, params, args.depth, PROMPTS, args.pairs)
        return
    ratios, same = [], True
    for n in range(args.pairs):
        prompt = lm.tokenizer.encode(PROMPTS[n % len(PROMPTS)])
        order = (False, True) if n % 2 == 0 else (True, False)
        out = {d: run(lm, prompt, params, args.depth, d) for d in order}
        same &= out[True][0] == out[False][0]
        ratios.append(out[True][1] / out[False][1])
        print(f"pair {n + 1}: off {out[False][1]:.1f} tok/s, on {out[True][1]:.1f} tok/s, ratio {ratios[-1]:.3f}",
              flush=True)
    print(f"details on/off tokens per second: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(ratios)} pairs; "
          f"identical tokens in every pair: {same}")


if __name__ == "__main__":
    main()
