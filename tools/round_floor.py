"""The device work an exact round must do beyond the cost model's calls, timed piece by piece.

    python tools/round_floor.py [--model assets/dyno-tiny] [--depths 1 3] [--reps 15] [--json FILE]

Issue 18 holds a round against Tv(k) + k*Td (speculative/measure/cost_model.py). A round also computes,
whatever the host does: the head's rows for the k+1 verified positions in one call where the cost
model's head step has one row, and the acceptance rule on the k+1 verify rows (greedy: the
log-softmax and argmax plain decoding takes; sampled: the warp plain decoding's sampler applies to
each row, top-p's whole-vocabulary sort included, then the lossless rule). A sampled draft also
warps and draws where the cost model's draft step takes the greedy pick. These are timed here
with the cost model's own method (queued calls, the difference of bursts, round-robin), on the
bundled suite's first prompt; `floor` is their sum (the head's extra rows counted as 0 when they
time below one row), and `efficiency at most` is
(Tv + k*Td) / (Tv + k*Td + floor): what no cut of host time can exceed on this backend.
"""

import argparse
import json
import pathlib
import sys

import mlx.core as mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from speculative.config import SamplingParams  # noqa: E402
from speculative.measure.cost_model import cost_model, interleaved  # noqa: E402
from speculative.draft_vocab.head import draft_lm_head, greedy_token  # noqa: E402
from speculative.round.sampling import draft_params, draw, log_softmax, warp  # noqa: E402
from speculative.round.verify import greedy_accept, lossless_accept  # noqa: E402

SAMPLED = SamplingParams(temperature=0.6, top_p=0.95, top_k=20)


def pieces(lm, prompt, k: int, reps: int) -> dict:
    """Seconds per call of each piece at depth k."""
    target, head = lm.target, lm.head
    tokens = mx.array(list(prompt))[None]
    hidden = target.hidden(tokens, target.make_cache())
    cache = head.make_cache()
    head(target.embed(tokens), hidden, cache)
    mx.eval([c.state for c in cache] + [hidden])
    offset = cache[0].offset
    rows = tokens[:, -(k + 1):]  # k+1 positions' tokens and hiddens, as a round's head rows
    row_hidden = hidden[:, -(k + 1):]
    logits = target.lm_head(row_hidden)[0]  # [k+1, V] verify rows
    drafts = rows[0, 1:]
    projection = draft_lm_head(lm, None)
    q = mx.exp(warp(projection(hidden[:, -1]), draft_params(SAMPLED, lm.vocab_size)))
    mx.eval(logits, q)
    key = mx.random.key(0)

    def head_call(n):
        def build():
            out = head(target.embed(rows[:, -n:]), row_hidden[:, -n:], cache)
            cache[0].trim(cache[0].offset - offset)
            return out
        return build

    builds = {
        "head, 1 row": head_call(1),
        f"head, {k + 1} rows": head_call(k + 1),
        "greedy acceptance": lambda: greedy_accept(drafts, log_softmax(logits)),
        "sampled acceptance": lambda: lossless_accept(drafts, mx.repeat(q, k, axis=0), mx.exp(warp(logits, SAMPLED)),
                                                      key),
        "greedy draft pick": lambda: greedy_token(projection, hidden[:, -1]),
        "sampled draft pick": lambda: draw(warp(projection(hidden[:, -1]), draft_params(SAMPLED, lm.vocab_size)), key),
    }
    return interleaved(builds, reps)


def main() -> None:
    from speculative.loader import load_checkpoint
    from speculative.measure.suites import SUITES, encode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/dyno-tiny")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    lm = load_checkpoint(args.model, mode="mtp")
    prompt = encode(lm.tokenizer, SUITES["code"][0])
    out = {"model": args.model, "device": str(mx.default_device()), "mlx": mx.__version__, "depths": []}
    print(f"{args.model}, {mx.default_device()}, MLX {mx.__version__}; ms per call (median of {args.reps})")
    for k in args.depths:
        t = {name: s * 1e3 for name, s in pieces(lm, prompt, k, args.reps).items()}
        c = cost_model(lm, prompt, [k], reps=args.reps)
        calls = (c["Tv"][k] + k * c["Td"]) * 1e3
        rows = max(0.0, t[f"head, {k + 1} rows"] - t["head, 1 row"])  # at depth 1 within noise of 0
        floor = {"greedy": rows + t["greedy acceptance"],
                 "sampled": rows + t["sampled acceptance"] + k * (t["sampled draft pick"] - t["greedy draft pick"])}
        print(f"\ndepth {k}: model calls Tv({k}) + {k}*Td = {calls:.2f} ms")
        for name, ms in t.items():
            print(f"  {name:<22}{ms:>7.3f}")
        for mode, ms in floor.items():
            print(f"  {mode:<8} floor {ms:.2f} ms per round; efficiency at most {calls / (calls + ms):.3f}")
        out["depths"].append({"depth": k, "pieces_ms": t, "model_calls_ms": calls, "floor_ms": floor,
                              "efficiency_at_most": {m: calls / (calls + ms) for m, ms in floor.items()}})
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
