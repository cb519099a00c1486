"""Data files for the head-tuning measurements in docs/heads.md (Tuning a head: measured).

    python tools/head_tune_data.py code /tmp/tune-data      # dyno-tiny: Python standard library
    python tools/head_tune_data.py licenses /tmp/ft-data    # a fine-tune on another kind of text
    python tools/head_tune_data.py code-more /tmp/tune-more # dyno-tiny: many more training modules

`code`: tune-prompts.jsonl, 6 openings of 300 characters from each of 8 modules dyno-tiny was trained
on (the model continues them), and held-out.jsonl, 8 modules from tools/tiny_data.py's HELD_OUT list,
never trained on, as documents. `code-more`: the same two files; tune-docs.jsonl, training modules
(tools/tiny_data.py's list: not HELD_OUT, not its skipped folders) of 2-60 kB as documents, every k-th
in path order, up to 900 kB of source (about 16 times the `code` prompts' tokens, with nothing to
continue: continuing is the slow part); and tune-prompts-more.jsonl, the `code` prompts and 6 openings
of 300 characters from each of the first 16 of those modules (144 prompts). None of the held-out
modules is in either. `licenses`: the license texts of /usr/share/common-licenses (Debian),
English legal prose: train.jsonl and valid.jsonl in 1,200-character chunks for `mlx_lm lora`,
tune-prompts.jsonl (200-character openings of every sixth chunk) and held-out.jsonl (three other
licenses, as documents).
"""

import ast
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


def _tiny_data_lists():
    """HELD_OUT, SKIP_DIRS and SKIP_FILES from tools/tiny_data.py, read without importing it (it needs torch)."""
    tree = ast.parse((Path(__file__).parent / "tiny_data.py").read_text())
    wanted = {"HELD_OUT", "SKIP_DIRS", "SKIP_FILES"}
    return {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name) and t.id in wanted}


def code_more(out: Path, budget: int = 900_000) -> None:
    code(out)
    lists = _tiny_data_lists()
    root = Path(sysconfig.get_paths()["stdlib"])
    held = lambda rel: any(rel == h or (h.endswith("/") and rel.startswith(h)) for h in lists["HELD_OUT"])
    eligible = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not (lists["SKIP_DIRS"].intersection(path.relative_to(root).parts) or rel.startswith(lists["SKIP_FILES"])
                or held(rel) or not 2_000 <= path.stat().st_size <= 60_000):
            eligible.append(path)
    # Every k-th module, so the documents spread over the whole library rather than its first packages.
    k = max(1, sum(p.stat().st_size for p in eligible) // budget)
    docs, size = [], 0
    for path in eligible[::k]:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append({"text": text})
        size += len(text)
        if size >= budget:
            break
    jsonl(out / "tune-docs.jsonl", docs)
    # The model's own text is what moved the head: 6 openings of each of the first 16 of those modules
    # too, with the `code` prompts, for a tune on 3 times their continuations.
    more = [{"prompt": d["text"][i * (len(d["text"]) // 6):][:300]} for d in docs[:16] for i in range(6)]
    jsonl(out / "tune-prompts-more.jsonl", [json.loads(line) for line in
                                            (out / "tune-prompts.jsonl").read_text().splitlines()] + more)


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
    {"code": code, "code-more": code_more, "licenses": licenses}[kind](out)
