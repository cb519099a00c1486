"""What a float32 product costs by its number of rows, through the BLAS MLX's CPU backend is using.

    tools/with_openblas.sh python tools/blas_rows.py [--rows 1,2,3,4,5,8] [--reps 7]

A verify of k drafts multiplies k+1 rows by every weight matrix, so the stand-in's Tv(k) follows
what the BLAS charges for k+1 rows. Each product is one of the 0.8B shape's (hidden 1024, MLP 3584,
the linear-attention layers' qkv 6144); rows take turns within each rep, so the machine's drift lands on all.
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from speculative.measure.blas import detect  # noqa: E402
from speculative.measure.cost_model import interleaved  # noqa: E402

# (in, out) of the 0.8B's products: the MLP's up and down projections, the linear-attention layers' qkv
SHAPES = [(1024, 3584), (3584, 1024), (1024, 6144)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,5,8", help="row counts, comma-separated (ratios against the first)")
    ap.add_argument("--reps", type=int, default=7, help="rounds of every row count (the median is shown)")
    ap.add_argument("--calls", type=int, default=20, help="products queued per timed burst")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows takes row counts separated by commas, e.g. 1,2,4: {args.rows!r}")
    if min(rows) < 1 or args.reps < 1 or args.calls < 1:
        ap.error("--rows, --reps and --calls must be positive")
    print(detect().line())
    key = mx.random.key(0)
    for k_in, n_out in SHAPES:
        w = mx.random.normal((n_out, k_in), key=key)
        xs = {m: mx.random.normal((m, k_in), key=key) for m in rows}
        mx.eval(w, *xs.values())
        # the cost model's timing: products queued as decoding queues them, row counts round-robin
        t = interleaved({m: (lambda x=x: x @ w.T) for m, x in xs.items()}, args.reps, burst=args.calls)
        print(f"[rows, {k_in}] x [{k_in}, {n_out}]: " + "  ".join(
            f"{m} rows {s * 1e3:.2f} ms ({s / t[rows[0]]:.2f}x)" for m, s in t.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
