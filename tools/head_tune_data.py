"""Data files for the head-tuning measurements in docs/heads.md (Tuning a head: measured).

    python tools/head_tune_data.py code /tmp/tune-data      # dyno-tiny: Python standard library
    python tools/head_tune_data.py licenses /tmp/ft-data    # a fine-tune on another kind of text

`code`: tune-prompts.jsonl, 6 openings of 300 characters from each of 8 modules dyno-tiny was trained
on (the model continues them), and held-out.jsonl, 8 modules from tools/tiny_data.py's HELD_OUT list,
never trained on, as documents. `licenses`: the license texts of /usr/share/common-licenses (Debian),
English legal prose: train.jsonl and valid.jsonl in 1,200-character chunks for `mlx_lm lora`,
tune-prompts.jsonl (200-character openings of every sixth chunk) and held-out.jsonl (three other
licenses, as documents).
"""

import json
import sys
import sysconfig
from pathlib import Path

CODE_TRAIN = ["argparse.py", "shutil.py", "tempfile.py", "typing.py", "dataclasses.py", "pathlib.py",
              "logging/__init__.py", "inspect.py"]
CODE_HELD = ["csv.py", "difflib.py", "fractions.py", "heapq.py", "shlex.py", "statistics.py", "textwrap.py",
             "calendar.py"]
LICENSES = Path("/usr/share/common-licenses")
LICENSE_TRAIN = ["GPL-1", "GPL-2", "GPL-3", "LGPL-2", "LGPL-2.1", "LGPL-3", "GFDL-1.2", "GFDL-1.3", "MPL-1.1",
                 "Artistic", "BSD"]
LICENSE_HELD = ["Apache-2.0", "MPL-2.0", "CC0-1.0"]


def jsonl(path: Path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def code(out: Path) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in CODE_TRAIN:
        text = (root / name).read_text()
        step = len(text) // 6
        prompts += [{"prompt": text[i * step : i * step + 300]} for i in range(6)]
    jsonl(out / "tune-prompts.jsonl", prompts)
    jsonl(out / "held-out.jsonl", [{"text": (root / n).read_text()} for n in CODE_HELD])


def licenses(out: Path) -> None:
    chunks = [t[i : i + 1200] for n in LICENSE_TRAIN for t in [(LICENSES / n).read_text()]
              for i in range(0, len(t), 1200)]
    jsonl(out / "train.jsonl", [{"text": c} for c in chunks[:-10]])
    jsonl(out / "valid.jsonl", [{"text": c} for c in chunks[-10:]])
    jsonl(out / "tune-prompts.jsonl", [{"prompt": c[:200]} for c in chunks[::6]])
    jsonl(out / "held-out.jsonl", [{"text": (LICENSES / n).read_text()} for n in LICENSE_HELD])


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    {"code": code, "licenses": licenses}[kind](out)
