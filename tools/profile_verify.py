"""Where the extra cost of verifying k drafts goes: Tv(k) - T1, split into matmuls, the Gated
DeltaNet recurrence and the rest, on this machine's MLX backend.

    python tools/profile_verify.py [--model assets/dyno-tiny] [--depth 3] [--reps 40]

Every figure is a median of round-robin bursts (speculative.measure.bench's timing). "Matmuls" times every
nn.Linear of the model and the lm_head alone on inputs of 1 and k+1 rows; "recurrence" times the
verify pass with the recurrence replaced by a stand-in of the same shapes that computes nothing.
Dense, unquantized models off the Metal kernel path only. The split is of the plain (uncompiled) pass; the engine's pass, with each Gated DeltaNet layer
compiled where that is bit-exact, is timed beside it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from speculative import target as target_mod  # noqa: E402
from speculative.rollback import restore, snapshot  # noqa: E402
from speculative.measure.cost_model import interleaved  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from speculative.target import Target  # noqa: E402

REAL_RECURRENCE = target_mod._recurrence_with_states


def no_recurrence(q, k, v, a, b, layer, state):
    """Same output shapes, no work: the verify pass without its recurrence."""
    return mx.zeros(v.shape, v.dtype), [state] * q.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/dyno-tiny")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()

    lm = load_checkpoint(args.model)
    target = lm.target
    gdn = next(layer.linear_attn for layer in target.body.layers if layer.is_linear)
    others = [type(m).__name__ for _, m in lm.model.named_modules() if "Quantized" in type(m).__name__
              or "Switch" in type(m).__name__]
    if target_mod.kernel_path(gdn) or others:
        # The split swaps out the portable recurrence and times nn.Linear alone: on the Metal
        # kernel path, or with quantized or expert layers, it would not add up.
        sys.exit(f"profile_verify: only dense, unquantized models off the Metal kernel path "
                 f"({'Metal kernel path' if not others else others[0]})")
    cache = target.make_cache()
    target.hidden(mx.arange(100, 400)[None], cache)
    mx.eval([c.state for c in cache])
    snap = snapshot(cache)
    rows = (1, args.depth + 1)

    passes = {"engine": target, "plain": Target(lm.model, compile_layers=False),
              "no recurrence": Target(lm.model, compile_layers=False)}

    def verify(n, name):
        def build():
            if name == "no recurrence":
                target_mod._recurrence_with_states = no_recurrence
            try:
                logits, _, tapes = passes[name].verify(mx.full((1, n), 7), cache)
            finally:
                target_mod._recurrence_with_states = REAL_RECURRENCE
            restore(cache, snap)
            return [mx.argmax(logits, -1)] + [t.states[-1] for t in tapes]
        return build

    linears = [m for _, m in lm.model.named_modules() if isinstance(m, nn.Linear)]
    inputs = {n: [mx.random.normal((1, n, m.weight.shape[-1])).astype(mx.bfloat16) for m in linears] for n in rows}
    hidden = {n: mx.random.normal((1, n, target.args.hidden_size)).astype(mx.bfloat16) for n in rows}
    mx.eval(inputs, hidden)

    def matmuls(n):
        return lambda: [m(x) for m, x in zip(linears, inputs[n])] + [target.lm_head(hidden[n])]

    builds = {}
    for n in rows:
        for name in passes:
            builds[(name, n)] = verify(n, name)
        builds[("matmuls", n)] = matmuls(n)
    t = {key: v * 1e3 for key, v in interleaved(builds, args.reps).items()}
    one, many = rows
    extra = t[("plain", many)] - t[("plain", one)]
    recurrence = (t[("plain", many)] - t[("no recurrence", many)]) - (t[("plain", one)] - t[("no recurrence", one)])
    mm = t[("matmuls", many)] - t[("matmuls", one)]
    print(f"{args.model} ({len(linears)} linear layers + lm_head, {mx.default_device()})")
    for name in ("plain", "engine"):
        print(f"  {name} verify pass: 1 token {t[(name, one)]:.2f} ms, {many} tokens {t[(name, many)]:.2f} ms")
    print(f"  plain: {many} tokens - 1 token = {extra:.2f} ms: matmuls {mm:.2f} ({mm / extra:.0%}), "
          f"GDN recurrence {recurrence:.2f} ({recurrence / extra:.0%}), rest {extra - mm - recurrence:.2f}; "
          f"{extra / args.depth / t[('plain', one)]:.2f} x the 1-token pass per extra token")


if __name__ == "__main__":
    main()
