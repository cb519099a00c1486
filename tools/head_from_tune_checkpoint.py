"""Write the head of a `dyno head tune` checkpoint (the `.<out>.tune` folder) as a head folder, to measure a
tune stopped before its last step (`dyno head eval --mtp-head OUT`). The tune's own --out is written only
after its last step; this is for measuring a stopped one, and its folder says which step it holds.

    python tools/head_from_tune_checkpoint.py /tmp/.tuned.tune /tmp/tuned-step-250 [--model assets/dyno-tiny]
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from speculative import load_model
from speculative.errors import DynoError
from speculative.heads.mtp import HeadWeights, write_head_folder
from speculative.measure.head_tune import STATE_INFO, STATE_WEIGHTS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("state", type=Path, help="the tune's checkpoint folder (.<out>.tune)")
    ap.add_argument("out", type=Path, help="the head folder to write")
    ap.add_argument("--model", default="assets/dyno-tiny", help="the model tuned for (its head gives the dtypes)")
    args = ap.parse_args()
    try:
        saved, meta = mx.load(str(args.state / STATE_WEIGHTS), return_metadata=True)
        info = json.loads((args.state / STATE_INFO).read_text())
    except (OSError, ValueError, RuntimeError) as e:
        print(f"head_from_tune_checkpoint: error: cannot read the checkpoint in {args.state}: {e}", file=sys.stderr)
        return 2
    try:
        lm = load_model(args.model, mode="mtp", draft_depth=3, draft_vocab=None, head_bits=16,
                        notify=lambda *a: None)[0]
        like = dict(tree_flatten(lm.head.parameters()))
        tensors = {k[5:]: v for k, v in saved.items() if k.startswith("head.")}
        if tensors.keys() != like.keys():
            raise DynoError(f"the checkpoint in {args.state} is not a head for {args.model}")
        tensors = {k: v.astype(like[k].dtype) for k, v in tensors.items()}
        step = int(meta["step"])
        weights = HeadWeights(tensors, True, f"dyno head tune checkpoint {args.state} at step {step}",
                              {"source": {"via": "tools/head_from_tune_checkpoint.py"}})
        write_head_folder(args.out, weights, lm.text_config,
                          extra={"tune_checkpoint": {"step": step, "signature": info.get("signature")}})
    except DynoError as e:
        print(f"head_from_tune_checkpoint: error: {e.message}", file=sys.stderr)
        return 2
    steps = ((info.get("signature") or {}).get("settings") or {}).get("steps")
    print(f"head of step {step}{f' of {steps}' if steps else ''} written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
