"""What indexing a row's context costs: the copy drafter's n-gram tables (speculative/round/copy_index.py)
against a suffix automaton, per token appended and per match asked, on real text (the running Python's
standard library sources, tokenized by the bundled model's tokenizer) and on text that never repeats.

    python tools/copy_index_bench.py [--tokens 200000]

The automaton finds the longest repeated suffix of any length (its state's suffix link) and keeps, per
state, one end position (the first it was given): not always the latest occurrence.
"""

import argparse
import inspect
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from speculative.round.copy_index import ContextIndex  # noqa: E402


class SuffixAutomaton:
    """The textbook online suffix automaton over token ids, each state with one end position."""

    def __init__(self):
        self.next = [{}]
        self.link = [-1]
        self.length = [0]
        self.end = [-1]
        self.last = 0
        self.n = 0

    def extend(self, tokens):
        for t in tokens:
            self._add(t)

    def _add(self, c):
        cur = len(self.next)
        self.next.append({})
        self.length.append(self.length[self.last] + 1)
        self.link.append(-1)
        self.end.append(self.n)
        p = self.last
        while p != -1 and c not in self.next[p]:
            self.next[p][c] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][c]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = len(self.next)
                self.next.append(dict(self.next[q]))
                self.length.append(self.length[p] + 1)
                self.link.append(self.link[q])
                self.end.append(self.end[q])
                while p != -1 and self.next[p].get(c) == q:
                    self.next[p][c] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur
        self.n += 1

    def match(self):
        """(length, an earlier end) of the longest suffix that occurred before, or None."""
        s = self.link[self.last]
        return (self.length[s], self.end[s]) if s > 0 else None


def stdlib_tokens(tokenizer, limit):
    import email, json as j, logging, argparse as a, collections, typing  # noqa: E401  (sources only)
    out = []
    for module in (logging, a, collections, typing, email, j, inspect):
        out += tokenizer.encode(inspect.getsource(module))
        if len(out) >= limit:
            break
    return out[:limit]


def time_it(make, tokens, step=4):
    """Seconds per token appended (in rounds of `step` tokens, each followed by a match), and matches found."""
    index = make()
    found = 0
    start = time.perf_counter()
    for i in range(0, len(tokens), step):
        index.extend(tokens[i : i + step])
        found += index.match() is not None
    return (time.perf_counter() - start) / len(tokens), found / -(-len(tokens) // step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from pathlib import Path

    tokenizer = load_tokenizer(Path(__file__).resolve().parent.parent / "assets" / "dyno-tiny")
    real = stdlib_tokens(tokenizer, args.tokens)
    fresh = list(range(len(real)))  # nothing ever repeats
    rng = random.Random(0)
    rng.shuffle(fresh)
    rows = {}
    for name, make in (("ngram (8,4,3)", lambda: ContextIndex((8, 4, 3))), ("ngram (4,2)", lambda: ContextIndex((4, 2))),
                       ("ngram (2,)", lambda: ContextIndex((2,))), ("suffix automaton", SuffixAutomaton)):
        for text, tokens in (("stdlib", real), ("no repeats", fresh)):
            per_token, hit = time_it(make, tokens)
            rows[f"{name} / {text}"] = {"us_per_token": round(per_token * 1e6, 3), "rounds_with_a_match": round(hit, 3)}
            print(f"{name:18s} {text:10s} {per_token * 1e6:7.2f} us/token, a match in {hit:.0%} of rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": len(real), "python": sys.version.split()[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
