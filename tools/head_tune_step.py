"""One `dyno head tune` step on a real-shaped random checkpoint: its time and MLX's peak memory.

    tools/with_openblas.sh python tools/head_tune_step.py --shape qwen3.5-0.8b --dtype float32 \
        --json assets/bench/qwen3.5-0.8b-f32-openblas-head-tune-step-cpu.json

Builds the checkpoint (tools/standin/random_checkpoint.py) in a temporary folder removed at exit,
loads it with its head, and runs the tune's own step (speculative/measure/head_tune.py: the trunk's forward for
the targets, the head unrolled --depth steps, KL to the top-k, AdamW) on random token windows. Step 1
includes MLX's first-use costs; the record keeps every step's time.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from speculative.measure import head_tune as tuning  # noqa: E402
from speculative.loader import load_checkpoint  # noqa: E402
from tools.standin import shapes  # noqa: E402
from speculative.measure.blas import detect  # noqa: E402
from tools.standin.random_checkpoint import built, scaled_down  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, choices=shapes.names())
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--scaled-down", action="store_true", help="the shape's widths cut down: a smoke test")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args()
    config = shapes.load(args.shape)["text_config"]
    if args.scaled_down:
        config = scaled_down(config)
    with built(config, dtype=getattr(mx, args.dtype)) as (folder, _):
        lm = load_checkpoint(folder, mode="mtp", head_bits=16)
        loaded = mx.get_active_memory()
        mx.reset_peak_memory()
        vocab = lm.target.args.vocab_size
        n = args.batch * (args.steps + 2)
        stream = mx.random.randint(0, vocab, (n * args.seq_len,), key=mx.random.key(0)).tolist()
        settings = tuning.TuneSettings(steps=args.steps, seq_len=args.seq_len, batch=args.batch, depth=args.depth,
                                       held_out=1 / (args.steps + 2), checkpoint_every=10**6, estimate_every=10**6)
        run = tuning.Tune(lm, stream, settings, Path("/nonexistent"), {})
        times = []
        start = time.perf_counter()
        for _ in run.run():
            now = time.perf_counter()
            times.append(round(now - start, 3))
            start = now
        record = {
            "what": "one dyno head tune step (trunk forward for targets, head unrolled, KL top-k, AdamW), random windows",
            "command": " ".join(["tools/with_openblas.sh", "python", *sys.argv]),
            "shape": args.shape, "dtype": args.dtype, "scaled_down": args.scaled_down,
            "seq_len": args.seq_len, "batch": args.batch, "depth": args.depth, "top_k": settings.top_k,
            "vocab": vocab, "step_seconds": times,
            "model_bytes": loaded, "peak_bytes_during_steps": mx.get_peak_memory(),
            "head_params": sum(v.size for _, v in tree_flatten(run.head.parameters())),
            "blas": detect().as_json(), "machine": platform.machine(), "python": platform.python_version(),
            "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
