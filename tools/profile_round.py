"""Where a speculative round's time goes: device time and exposed host time per phase.

    python tools/profile_round.py [--model assets/dyno-tiny] [--depths 1 3] [--max-tokens 200]
                                  [--suite code] [--pairs 1] [--temp 0] [--json FILE]

Method. The engine is not changed: `Profiled` is the MTP head as a drafter (round/drafter.py),
passed to engine.generate as its `drafter=`; on its first drafts it wraps, on that instance only,
the calls the driver (batched.BatchSpeculator, at width 1) already makes in `step`, so each phase
of a round ends at a call the engine makes anyway:

    verify        step entry -> `target.verify` returns (the k+1-token trunk pass over the drafts
                  the previous round queued)
    acceptance    -> `_head` is entered (logits processors, the acceptance rule)
    head rows     -> the round's host sync (`_sync`) returns (the head's rows for every position
                  the round may keep, and reading the outcome to Python)
    rollback      -> `_emit` is entered (trunk cache trim, GDN commit, head cache trim)
    drafts        -> the drafter's `propose` returns (the next round's k head steps, draft
                  lm_head, pick); entered from the emit phase, which it interrupts
    emit          -> the next `step` entry (bookkeeping, yielding the tokens, generate()'s loop)

In the instrumented run every phase ends with a barrier: mx.eval of what the phase produced (the
verify logits and hiddens; the head rows' tokens, i.e. the acceptance; the head's output and cache
and the outcome; the trunk cache state; the drafts) and mx.synchronize(). A phase's device time is the time spent blocked in that barrier; its
host time is its wall time minus that, i.e. the Python graph building and bookkeeping the device
could not overlap. The phases are contiguous, so they add up to the instrumented round's wall time.
The blocked time also holds MLX's own dispatch of the graph (encoding on Metal, scheduling on the
CPU backend), so "device" is an upper bound on compute and "host" a lower bound on Python work.

Barriers change overlap: the engine queues the verify pass (async_eval) while it builds the
acceptance and head-row graphs, and the next drafts while the caller handles the tokens and the
next verify graph is built, and a barrier serializes them.
So the instrumented round is longer than the real one. The tool therefore also times the same
prompt without barriers (only a clock read at each `step` entry; identical tokens are checked)
and reports, per depth, the uninstrumented round time, the model calls the cost model allows
(Tv(k) + k*Td, speculative/measure/cost_model.py, timed right before each prompt's pair of runs, since
this machine drifts within minutes) and their difference: the exposed host time per round, what
issue 18 sets out to cut. That difference also holds the device work outside the model calls
(the acceptance rule, the GDN commit, a sampler's warp), which the table shows per phase. The
first round of each run is left out (allocation, first-use compiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from speculative import engine  # noqa: E402
from speculative.config import SamplingParams, SpecConfig  # noqa: E402
from speculative.measure.cost_model import cost_model  # noqa: E402
from speculative.round.drafter import HeadDrafter  # noqa: E402
from speculative.stats import GenerationStats  # noqa: E402

PHASES = ("verify", "acceptance", "head rows", "rollback", "drafts", "emit")


def _arrays(x) -> list:
    """The mx.arrays in a nest of tuples, lists and Nones."""
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for item in x for a in _arrays(item)]
    return []


class _TargetProxy:
    """The trunk adapter with its verify pass ending the `verify` phase."""

    def __init__(self, target, owner: "Profiled"):
        self._target, self._owner = target, owner

    def __getattr__(self, name):
        return getattr(self._target, name)

    def verify(self, tokens, cache, rope=None):
        logits, hidden, tapes = self._target.verify(tokens, cache, rope)
        if self._owner._phase == "verify":
            self._owner._wait([logits, hidden])  # what the sync needs; the tapes are rollback's
            self._owner._mark("acceptance")
        return logits, hidden, tapes


class Profiled(HeadDrafter):
    """The MTP head as drafter, recording per-round phase times of the driver that asks it; with
    `barriers` False only round starts. On its first drafts it wraps that driver's calls (on the
    instance: the class is untouched)."""

    def __init__(self, barriers: bool = True):
        super().__init__()
        self.barriers = barriers
        self.batch = None  # the driver, once it asked for drafts
        self.round_starts: List[float] = []  # perf_counter at every round's start
        self.rounds: List[Dict[str, List[float]]] = []  # closed rounds: phase -> [wall, device]
        self._phase: Optional[str] = None
        self._record: Optional[Dict[str, List[float]]] = None
        self._t = 0.0

    # -- accounting
    def _wait(self, arrays) -> None:
        start = time.perf_counter()
        mx.eval(_arrays(list(arrays)))
        mx.synchronize()
        self._record[self._phase][1] += time.perf_counter() - start

    def _mark(self, nxt: Optional[str]) -> None:
        now = time.perf_counter()
        self._record[self._phase][0] += now - self._t
        self._t, self._phase = now, nxt

    def _open(self) -> None:
        """A round starts now."""
        self._record = {p: [0.0, 0.0] for p in PHASES}
        self._phase = "verify"
        self.round_starts.append(self._t)

    # -- the drafts
    def propose(self, rounds, budgets):
        if self.batch is None:  # the first round: its drafts are made before its clock starts, as later rounds' are
            self._instrument(rounds)
            if not self.barriers:
                self.round_starts.append(time.perf_counter())
                return super().propose(rounds, budgets)
            out = super().propose(rounds, budgets)
            mx.eval(_arrays([out.tokens, out.probs]))
            self._t = time.perf_counter()
            self._open()
            return out
        if self.barriers and self._phase == "emit":
            self._mark("drafts")
        out = super().propose(rounds, budgets)
        if self.barriers and self._phase == "drafts":
            self._wait([out.tokens, out.probs])
            self._mark("emit")
        return out

    # -- the driver's calls, wrapped on its instance
    def _instrument(self, batch) -> None:
        self.batch = batch
        step = batch.step
        if not self.barriers:
            def timed_step(*args, **kwargs):
                self.round_starts.append(time.perf_counter())
                return step(*args, **kwargs)

            batch.step = timed_step
            return
        head, sync, emit = batch._head, batch._sync, batch._emit
        batch.target = _TargetProxy(batch.target, self)

        def profiled_step(*args, **kwargs):
            if self._phase == "emit":  # close the previous round at this round's start (its clock read)
                self._wait([])
                self._mark(None)
                self.rounds.append(self._record)
                self._open()
            return step(*args, **kwargs)

        def profiled_head(tokens, hidden, *args, **kwargs):
            if self._phase != "acceptance":  # a join's rows, a catch-up, the draft recursion
                return head(tokens, hidden, *args, **kwargs)
            self._wait([tokens])  # the acceptance rule's outcome, which the rows' tokens are made of
            self._mark("head rows")
            out = head(tokens, hidden, *args, **kwargs)
            self._wait([out] + [c.state for c in batch.head_cache])
            return out

        def profiled_sync(*arrays):
            if self._phase != "head rows":
                return sync(*arrays)
            self._wait(arrays)
            out = sync(*arrays)
            self._mark("rollback")
            return out

        def profiled_emit(*args, **kwargs):
            if self._phase == "rollback":
                self._wait([c.state for c in batch.trunk_cache])
                self._mark("emit")
            return emit(*args, **kwargs)

        batch.step, batch._head, batch._sync, batch._emit = profiled_step, profiled_head, profiled_sync, profiled_emit


def profile_run(lm, prompt: Sequence[int], depth: int, params: SamplingParams, barriers: bool,
                skip: int = 1) -> dict:
    """One generation through engine.generate: its tokens, rounds, and per-round timings (seconds).

    `phases`: per closed round after the first `skip`, phase -> (host, device); `walls`: those
    rounds' start-to-next-start times; `stats`: the generation's GenerationStats.
    """
    stats = GenerationStats()
    drafter = Profiled(barriers)
    for e in engine.generate(lm, prompt, params, SpecConfig("mtp", depth), drafter=drafter):
        stats.add(e)
    starts = drafter.round_starts
    walls = [b - a for a, b in zip(starts, starts[1:])][skip:]
    phases = [{p: (w - d, d) for p, (w, d) in r.items()} for r in drafter.rounds][skip:]
    return {"tokens": stats.tokens, "stats": stats, "walls": walls, "phases": phases}


def profile_depth(lm, prompts: List[List[int]], depth: int, params: SamplingParams, pairs: int = 1,
                  reps: int = 15) -> dict:
    """Per prompt (and pair): the cost model, then an uninstrumented and an instrumented run.

    The cost model is timed right beside the runs it is held against (this machine drifts by tens
    of percent within minutes); the model calls are its Tv(k) + k*Td, weighted by each block's
    uninstrumented rounds.
    """
    # Warm-up. On a GPU backend MLX builds kernels for each new shape (the attention's growing
    # key length among them), so there every prompt runs once at full length in both modes first.
    gpu = mx.default_device() == mx.gpu
    for prompt in prompts if gpu else prompts[:1]:
        for barriers in (False, True):
            profile_run(lm, prompt, depth, params if gpu else dataclasses.replace(params, max_tokens=24),
                        barriers)
    plain_walls, phases, costs, calls, identical = [], [], [], [], True
    stats = GenerationStats()  # the uninstrumented runs
    for _ in range(pairs):
        for prompt in prompts:
            c = cost_model(lm, prompt, [depth], reps=reps)
            costs.append(c)
            off = profile_run(lm, prompt, depth, params, barriers=False)
            on = profile_run(lm, prompt, depth, params, barriers=True)
            identical &= off["tokens"] == on["tokens"]
            plain_walls += off["walls"]
            calls += [c["Tv"][depth] + depth * c["Td"]] * len(off["walls"])
            phases += on["phases"]
            stats.merge(off["stats"])
    mean = {p: (statistics.fmean(r[p][0] for r in phases), statistics.fmean(r[p][1] for r in phases))
            for p in PHASES}
    round_ms = statistics.fmean(plain_walls) * 1e3
    model_calls_ms = statistics.fmean(calls) * 1e3
    return {"depth": depth, "rounds": len(phases), "plain_rounds": len(plain_walls),
            "tokens_per_round": stats.tokens_per_round,
            "cost_model_ms": {name: statistics.median(c[name] if name != "Tv" else c["Tv"][depth]
                                                      for c in costs) * 1e3 for name in ("T1", "Tv", "Td")},
            "phases_ms": {p: {"host": h * 1e3, "device": d * 1e3} for p, (h, d) in mean.items()},
            "instrumented_round_ms": sum(h + d for h, d in mean.values()) * 1e3,
            "round_ms": round_ms, "model_calls_ms": model_calls_ms,
            "exposed_host_ms": round_ms - model_calls_ms, "identical": identical}


def main() -> None:
    from speculative.loader import load_checkpoint
    from speculative.measure.blas import detect
    from speculative.measure.suites import SUITES, encode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/dyno-tiny")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--suite", default="code", choices=sorted(SUITES))
    ap.add_argument("--pairs", type=int, default=1, help="uninstrumented/instrumented runs per prompt")
    ap.add_argument("--temp", type=float, default=0.0, help="0: greedy; else with top-p 0.95, top-k 20")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    lm = load_checkpoint(args.model, mode="mtp")
    prompts = [encode(lm.tokenizer, item) for item in SUITES[args.suite]]
    params = (SamplingParams(max_tokens=args.max_tokens) if args.temp == 0 else
              SamplingParams(temperature=args.temp, top_p=0.95, top_k=20, max_tokens=args.max_tokens, seed=0))
    blas = detect()  # what float32 products go through: it decides which regime the figures are in
    out = {"command": " ".join(["python", *sys.argv]), "model": args.model, "suite": args.suite,
           "max_tokens": args.max_tokens, "temperature": args.temp, "pairs": args.pairs,
           "device": str(mx.default_device()), "mlx": mx.__version__, "blas": blas.as_json(), "depths": []}
    print(f"{args.model}, suite {args.suite}, {args.max_tokens} tokens, T={args.temp}, {mx.default_device()}, "
          f"MLX {mx.__version__}")
    print(blas.line())
    for k in args.depths:
        r = profile_depth(lm, prompts, k, params, args.pairs)
        out["depths"].append(r)
        cm = r["cost_model_ms"]
        print(f"\ndepth {k}: {r['rounds']} instrumented rounds, {r['tokens_per_round']:.2f} tokens/round, "
              f"identical tokens: {'yes' if r['identical'] else 'NO'}; cost model (median): "
              f"T1 {cm['T1']:.2f} ms, Tv({k}) {cm['Tv']:.2f} ms, Td {cm['Td']:.2f} ms")
        print(f"  {'phase':<13}{'host ms':>9}{'device ms':>11}")
        for p in PHASES:
            ph = r["phases_ms"][p]
            print(f"  {p:<13}{ph['host']:>9.2f}{ph['device']:>11.2f}")
        host = sum(ph["host"] for ph in r["phases_ms"].values())
        dev = sum(ph["device"] for ph in r["phases_ms"].values())
        print(f"  {'sum':<13}{host:>9.2f}{dev:>11.2f}   instrumented round {r['instrumented_round_ms']:.2f} ms")
        print(f"  uninstrumented round {r['round_ms']:.2f} ms; model calls Tv({k}) + {k}*Td = "
              f"{r['model_calls_ms']:.2f} ms; exposed host per round {r['exposed_host_ms']:.2f} ms")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
