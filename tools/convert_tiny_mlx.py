"""Convert dyno-tiny to MLX like community conversions do (mlx_lm.convert drops `mtp.*` and the vision tower).

    python tools/convert_tiny_mlx.py [--hf-path assets/dyno-tiny] [--mlx-path assets/dyno-tiny-mlx]

Equivalent to `python -m mlx_lm convert --hf-path assets/dyno-tiny --mlx-path assets/dyno-tiny-mlx` (bf16,
no quantization), followed by writing the model card that names the original as `base_model`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

import tiny_card


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-path", type=pathlib.Path, default=pathlib.Path("assets/dyno-tiny"))
    p.add_argument("--mlx-path", type=pathlib.Path, default=pathlib.Path("assets/dyno-tiny-mlx"))
    args = p.parse_args()
    if args.mlx_path.exists():
        shutil.rmtree(args.mlx_path)
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(args.hf_path),
                    "--mlx-path", str(args.mlx_path)], check=True)
    config = json.loads((args.mlx_path / "config.json").read_text())
    tc = config.get("text_config", config)
    assert tc.get("mtp_num_hidden_layers") == 1, "the conversion should keep mtp_num_hidden_layers"
    index = args.mlx_path / "model.safetensors.index.json"
    keys = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    assert not any("mtp." in k for k in keys), "the conversion should drop the head"
    record = json.loads((args.hf_path / "training_log.json").read_text())
    verification = None
    vpath = args.hf_path / "verification.json"
    if vpath.exists():
        verification = {"lines": json.loads(vpath.read_text())["mlx_lines"]}
    (args.mlx_path / "README.md").write_text(tiny_card.mlx_card(record, verification), encoding="utf-8")
    print(f"wrote {args.mlx_path}")


if __name__ == "__main__":
    main()
