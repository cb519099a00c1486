"""Where a round's work goes at a real shape, in CPU time: each round against its own model calls.

    tools/with_openblas.sh python tools/round_work.py --shape qwen3.5-0.8b --dtype float32 \
        --draft-vocab auto --depths 2,3 --context 16 --max-tokens 24 --keep /tmp/q08-f32 [--json FILE]

A real-shaped random checkpoint (tools/standin/random_checkpoint.py) drafts replayed to an
acceptance profile (speculative/measure/replay.py), output checked equal to plain greedy. As each
round's drafts are made (its drafter, Paired, is asked for them after the round before emitted its
tokens) the tool waits for them, then times the cost model's calls on the round's own caches, one
after the other and each waited for: Tv(k) (a k+1-token verify and its argmax) and Td (a head step
and its greedy pick over the drafts' projection); then the round runs as the engine runs it, to the
next round's drafts computed. Per round it reads wall time and each thread's CPU time
(tools/standin/thread_time.py): the worker threads' run time is the round's device work, set
against Tv(k) + k*Td's; the main thread's is its Python; the busiest worker's idle time is time it
had nothing queued. On a machine shared with other work, wall time drifts by the minute and CPU time
does not, so the ratios of CPU time say where the work goes where wall time cannot. It does not see
what a quiet machine's wall clock would add: memory bandwidth another process takes shows as run time.
"""

import argparse
import json
import statistics
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from speculative import engine  # noqa: E402
from speculative.config import SamplingParams, SpecConfig  # noqa: E402
from speculative.draft_vocab.head import DraftLMHead, greedy_token  # noqa: E402
from speculative.measure.cost_model import verify_call  # noqa: E402
from speculative.measure.replay import ReplayedDrafter, parse_profile  # noqa: E402
from tools.standin.thread_time import Usage, since, stamp  # noqa: E402
from speculative.stats import GenerationStats  # noqa: E402


def timed(build, main: int) -> Usage:
    """One call of `build`, waited for."""
    start = stamp()
    mx.eval(build())
    return since(start, main)


def draft_step(rounds, last, projection):
    """cost_model.draft_call on the driver's batch caches: a head step from (`last`, the rows' head
    hiddens) and its greedy pick, the head caches cut back by size after it (their offsets are per row)."""
    start = rounds.head_cache[0].size()

    def build():
        out = rounds._head(last, rounds.head_hidden)
        rounds._trim_head(start)
        return greedy_token(projection, out[:, -1])
    return build


class Paired(ReplayedDrafter):
    """Replayed drafts that, as each round's drafts are made, time its model calls on its own caches."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.main = threading.get_native_id()
        self.samples: List[Dict[str, Usage]] = []  # per closed round: round, Tv, Td
        self._open = None  # (stamp at the round's start, its calls)

    def _calls(self, rounds, k: int) -> Dict[str, Usage]:
        last = rounds.pending[None]  # the cost model's calls, on this round's own caches
        verify = verify_call(rounds.target, rounds.trunk_cache, last, k, rounds.rope)
        projection = self.projection if self.projection is not None else rounds.draft_lm_head
        draft = draft_step(rounds, last, projection)
        return {"Tv": timed(verify, self.main), "Td": timed(draft, self.main)}

    def propose(self, rounds, budgets):
        drafts = super().propose(rounds, budgets)
        mx.eval(drafts.tokens)  # a round ends with its successor's drafts computed
        if self._open is not None:
            start, calls = self._open
            self.samples.append({"round": since(start, self.main), **calls})
        calls = self._calls(rounds, max(budgets))
        self._open = (stamp(), calls)
        return drafts


def paired_rounds(lm, prompt: Sequence[int], reference: Sequence[int], depth: int, profile: Sequence[float],
                  max_tokens: int, seed: int = 0, draft_head: Optional[DraftLMHead] = None) -> List[Dict[str, Usage]]:
    """One replayed generation's rounds (the first left out: allocation), each with its calls."""
    drafter = Paired({None: reference}, profile, lm.vocab_size, seed, draft_head, row_seeds=False)
    stats = GenerationStats()
    for event in engine.generate(lm, prompt, SamplingParams(max_tokens=max_tokens), SpecConfig("mtp", depth),
                                 drafter=drafter):
        stats.add(event)
    if stats.tokens != list(reference[:max_tokens]):
        raise AssertionError(f"depth {depth}: the timed rounds changed the greedy output")
    return drafter.samples[1:]


def summary(samples: List[Dict[str, Usage]], depth: int) -> dict:
    """Medians (ms) per round, and the medians of the per-round ratios to Tv(k) + k*Td."""
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    out = {"rounds": len(samples)}
    for field in ("wall", "main", "workers"):
        calls = [getattr(s["Tv"], field) + depth * getattr(s["Td"], field) for s in samples]
        rounds = [getattr(s["round"], field) for s in samples]
        out[field] = {"round_ms": ms(rounds), "Tv_ms": ms([getattr(s["Tv"], field) for s in samples]),
                      "Td_ms": ms([getattr(s["Td"], field) for s in samples]), "calls_ms": ms(calls),
                      "ratio": statistics.median(r / c for r, c in zip(rounds, calls) if c > 0)}
    r = [s["round"] for s in samples]
    out["busiest_worker_ms"] = {"run": ms([u.busiest_run for u in r]), "wait": ms([u.busiest_wait for u in r]),
                                "idle": ms([u.busiest_idle for u in r])}
    return out


def main() -> int:
    from speculative.loader import load_checkpoint
    from tools.standin import shapes
    from speculative.measure.bench import run_mlx_lm
    from speculative.measure.blas import detect
    from tools.standin.random_checkpoint import built, scaled_down
    from tools.standin.scale import draft_head, draft_vocab_floor, random_prompt

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, choices=shapes.names())
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--draft-vocab", default="auto", metavar="N|auto|full")
    ap.add_argument("--acceptance", default="27b-code")
    ap.add_argument("--depths", default="2,3")
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--runs", type=int, default=1, help="generations per depth (each its own replay seed)")
    ap.add_argument("--keep", metavar="DIR", help="build the checkpoint in DIR and leave it, or reuse it")
    ap.add_argument("--root", help="where a temporary checkpoint goes")
    ap.add_argument("--scaled-down", action="store_true", help="the shape with its widths cut down (a smoke test)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    profile = parse_profile(args.acceptance)
    if len(profile) < max(depths):
        ap.error(f"the profile has {len(profile)} positions; --depths goes to {max(depths)}")
    config = shapes.load(args.shape)["text_config"]
    config = scaled_down(config) if args.scaled_down else config
    vocab = config["vocab_size"]
    if args.draft_vocab not in ("full", "auto") and not (args.draft_vocab.isdigit() and 0 < int(args.draft_vocab) < vocab):
        ap.error(f"--draft-vocab must be full, auto or a number of tokens below {vocab}: {args.draft_vocab!r}")
    blas = detect()
    print(blas.line())
    record = {"shape": args.shape, "dtype": args.dtype, "settings": vars(args), "blas": blas.as_json(),
              "mlx": mx.__version__, "depths": {}}
    with built(config, root=args.root, dtype=getattr(mx, args.dtype), keep=args.keep) as (model, _):
        lm = load_checkpoint(model, mode="mtp")
        prompt = random_prompt(args.context)
        reference = run_mlx_lm(lm, prompt, SamplingParams(max_tokens=args.max_tokens + max(depths))).tokens
        head = None
        if args.draft_vocab != "full":
            n = draft_vocab_floor(vocab) if args.draft_vocab == "auto" else int(args.draft_vocab)
            head = draft_head(lm, n, reference)
        drafts = f"{len(head.ids.tolist())} draft tokens" if head is not None else "the whole vocabulary"
        print(f"{args.shape} {args.dtype}, drafts over {drafts}, acceptance {list(profile)}, "
              f"{args.max_tokens} tokens, context {args.context}; per round, medians")
        print(f"{'depth':>5} {'clock':>8} {'round ms':>9} {'Tv ms':>7} {'Td ms':>6} {'calls ms':>9} {'round/calls':>11}")
        for k in depths:
            paired_rounds(lm, prompt, reference, k, profile, min(args.max_tokens, 8), draft_head=head)  # warm-up
            samples = []
            for i in range(args.runs):
                samples += paired_rounds(lm, prompt, reference, k, profile, args.max_tokens, seed=i, draft_head=head)
            s = record["depths"][k] = summary(samples, k)
            for field, name in (("workers", "workers"), ("main", "main"), ("wall", "wall")):
                f = s[field]
                print(f"{k:>5} {name:>8} {f['round_ms']:>9.1f} {f['Tv_ms']:>7.1f} {f['Td_ms']:>6.1f} "
                      f"{f['calls_ms']:>9.1f} {f['ratio']:>11.3f}")
            b = s["busiest_worker_ms"]
            print(f"{'':>5} busiest worker: run {b['run']:.1f} ms, waiting for a core {b['wait']:.1f} ms, "
                  f"idle {b['idle']:.1f} ms ({s['rounds']} rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
