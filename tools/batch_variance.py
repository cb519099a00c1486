"""Do rows computed together come out as rows computed one at a time, on this MLX backend?

    python tools/batch_variance.py [--model assets/dyno-tiny]

The verify pass scores k+1 positions in one call where plain decoding scores one per call, so
greedy output equals plain decoding bit for bit only where the backend's kernels give a row the
same value either way (docs/how-it-works.md, Exactness on GPU backends). Prints the largest difference of
matrix products (float32 and bf16, 2 and 4 rows) and of the model's logits for two tokens in one
call against one call each. 0.0 everywhere: row-invariant here.
"""

import argparse
import pathlib
import sys

import mlx.core as mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def matmul_rows(dtype, inner: int, out: int, rows: int, key: mx.array) -> float:
    """Rows of x @ w.T together against each row alone."""
    kw, kx = mx.random.split(key)
    w = mx.random.normal((out, inner), key=kw).astype(dtype)
    x = mx.random.normal((rows, inner), key=kx).astype(dtype)
    return max_diff(x @ w.T, mx.concatenate([x[i : i + 1] @ w.T for i in range(rows)]))


def model_rows(path: str, text: str = "def fibonacci(n):\n    if n < 2:\n        return n\n") -> float:
    """The model's logits for its next two tokens in one call against one call each."""
    from mlx_lm.models.cache import make_prompt_cache

    from speculative.loader import load_checkpoint

    lm = load_checkpoint(path)
    ids = lm.tokenizer.encode(text)
    together, alone = make_prompt_cache(lm.model), make_prompt_cache(lm.model)
    for cache in (together, alone):
        lm.model(mx.array([ids[:-2]]), cache=cache)
    both = lm.model(mx.array([ids[-2:]]), cache=together)
    each = mx.concatenate([lm.model(mx.array([[t]]), cache=alone) for t in ids[-2:]], axis=1)
    return max_diff(both, each)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/dyno-tiny")
    args = ap.parse_args()
    print(f"MLX {mx.__version__}, {mx.default_device()}")
    key = mx.random.key(0)
    for dtype in (mx.float32, mx.bfloat16):
        for inner, out, rows in ((64, 320, 2), (64, 320, 4), (1024, 4096, 2)):
            d = matmul_rows(dtype, inner, out, rows, key)
            print(f"matmul {str(dtype).split('.')[-1]:8} {rows} rows x {inner} -> {out}: max |together - alone| = {d:g}")
    print(f"{args.model}: logits, 2 tokens in one call vs one each: max |diff| = {model_rows(args.model):g}")


if __name__ == "__main__":
    main()
