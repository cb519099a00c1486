"""Position-1 acceptance of sampled drafts warped with and without top-p, teacher-forced.

    python tools/draft_warp.py [--model assets/dyno-tiny] [--temps 0.6 1.0] [--max-tokens 200]

The lossless rule is exact for any draft distribution q it is told, so the drafts may skip top-p's
sort of the whole vocabulary when top-k already bounds the support (speculative/round/sampling.py,
`draft_params`). This measures what that costs in acceptance: every prompt of the four bench
suites, plain mlx-lm's continuation (top-p 0.95, top-k 20, seed 0), one trunk pass and one head
pass over it, and at every continuation position the probability sum(min(p, q)) that the rule
accepts the head's draft, with q warped as p (top-p and top-k) and with top-k alone.
"""

import argparse
import dataclasses
import pathlib
import sys

import mlx.core as mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from speculative.measure.bench import run_mlx_lm  # noqa: E402
from speculative.config import SamplingParams  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from speculative.round.sampling import warp  # noqa: E402
from speculative.measure.suites import SUITES, encode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/dyno-tiny")
    ap.add_argument("--temps", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    lm = load_checkpoint(args.model, mode="mtp")
    print(f"{args.model} on {mx.default_device()}, MLX {mx.__version__}: position-1 acceptance, teacher-forced, "
          f"all suites, top-p 0.95, top-k 20")
    for temp in args.temps:
        params = SamplingParams(temperature=temp, top_p=0.95, top_k=20, max_tokens=args.max_tokens, seed=0)
        top_k_only = dataclasses.replace(params, top_p=1.0)
        same = cheap = positions = 0.0
        for items in SUITES.values():
            for item in items:
                prompt = encode(lm.tokenizer, item)
                tokens = mx.array(prompt + run_mlx_lm(lm, prompt, params).tokens)[None]
                hidden = lm.target.hidden(tokens, lm.target.make_cache())
                n = len(prompt)
                target = lm.target.lm_head(hidden[0, n:-1])  # the trunk's rows for the continuation
                # head row p takes (t_{p+1}, h_p) and drafts t_{p+2}, over the whole text
                head = lm.head(lm.target.embed(tokens[:, 1:]), hidden[:, :-1], lm.head.make_cache())
                draft = lm.target.lm_head(head[0, n - 1 : -1])
                p = mx.exp(warp(target, params))
                same += mx.minimum(p, mx.exp(warp(draft, params))).sum().item()
                cheap += mx.minimum(p, mx.exp(warp(draft, top_k_only))).sum().item()
                positions += target.shape[0]
        print(f"  T={temp:g}: {int(positions)} positions; q warped as p {same / positions:.4f}, "
              f"q without top-p {cheap / positions:.4f}")


if __name__ == "__main__":
    main()
