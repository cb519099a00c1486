"""How far each reading of a head's norms drafts from the model: the bundled head stored in each
mix (all shifted, none, only its own norms), read every way the 3 norm groups allow, scored as the
load scores them (heads/norm_decision.py: mean KL divergence from the trunk over the calibration text).

    python tools/norm_readings.py [--model assets/dyno-tiny-mlx] [--head assets/dyno-tiny]

A reading is named by the groups shifted at load: t (pre-fc and final norms), l (layer norms),
q (q/k norms), - none. The right reading of each row is marked with *.
"""

import argparse
from itertools import combinations
from pathlib import Path

import mlx.core as mx

from speculative.heads import norm_decision
from speculative.heads.mtp import ALL_NORMS, HeadWeights, build_head, read_checkpoint_head, shift_norms
from speculative.loader import load_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/dyno-tiny-mlx")
    ap.add_argument("--head", default="assets/dyno-tiny", help="a raw checkpoint whose head is used")
    args = ap.parse_args()
    lm = load_checkpoint(args.model, mode="off")
    raw = read_checkpoint_head(Path(args.head))
    readings = [c for n in range(4) for c in combinations(ALL_NORMS, n)]
    for stored in [ALL_NORMS, (), ("top",)]:
        weights = HeadWeights(shift_norms(raw.tensors, stored), None, args.head)
        head = build_head(lm.target.args, weights.decided((), {}), None, 16)
        scores = _scores(lm, head, weights, readings)
        right = tuple(g for g in ALL_NORMS if g not in stored)
        cells = [f"{''.join(g[0] for g in r) or '-'}{'*' if r == right else ''} {s:.2f}"
                 for r, s in zip(readings, scores)]
        print(f"stored shifted {'/'.join(stored) or 'none'}: " + ", ".join(cells))


def _scores(lm, head, weights, readings):
    """Mean KL(trunk || draft) of each reading, as decide_norms computes it."""
    t = lm.target
    ids = lm.tokenizer.encode(norm_decision.CALIBRATION_TEXT)[: norm_decision.CALIBRATION_TOKENS]
    tokens = mx.array(ids)[None]
    hidden = t.hidden(tokens, t.make_cache())
    trunk = norm_decision._log_softmax(t.lm_head(hidden[:, 1:]))
    out = []
    for groups in readings:
        head.load_weights(list(norm_decision._norms(weights, groups).items()), strict=False)
        rows = head(t.embed(tokens[:, 1:]), hidden[:, :-1], head.make_cache())
        drafts = norm_decision._log_softmax(t.lm_head(rows))
        out.append(mx.mean(mx.sum(mx.exp(trunk) * (trunk - drafts), axis=-1)).item())
    return out


if __name__ == "__main__":
    main()
