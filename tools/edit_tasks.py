"""An edit workload built at run time from real files no one here wrote: the running Python's standard
library sources. Each task is a prompt that shows a function and asks for it again, edited, and the
expected answer (the edited text), one JSON object a line, for `dyno bench --tasks FILE`:

    python tools/edit_tasks.py --out /tmp/edit-tasks.jsonl [--count 12]

Kinds: "rename" (an identifier renamed throughout the function), "quote" (the function quoted back
from the file by what it does), "line" (the function re-emitted with one line changed). The prompts
are plain text ending where the answer starts (a comment, then the answer's first line), so a base
model trained on code can continue them as well as a chat model can.
"""

import argparse
import ast
import inspect
import json
import random
import re
import sys

MODULES = ("textwrap", "shlex", "fnmatch", "glob", "difflib", "calendar", "string", "posixpath", "csv",
           "ftplib", "gettext", "tabnanny")


def functions(module_name: str):
    """(source of the whole module, [(name, source, docstring's first line)]) of its top-level functions
    of 6 to 40 lines."""
    module = __import__(module_name)
    source = inspect.getsource(module)
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and 6 <= node.end_lineno - node.lineno + 1 <= 40:
            text = ast.get_source_segment(source, node)
            doc = (ast.get_docstring(node) or "").strip().splitlines()
            out.append((node.name, text, doc[0] if doc else ""))
    return source, out


def rename_task(name, text, rng):
    """Rename one of the function's parameters throughout it."""
    args = re.findall(r"\b([a-z_][a-z0-9_]{2,})\b", text.split("\n", 1)[0].split("(", 1)[1])
    args = [a for a in args if a not in ("self", "None", "True", "False")]
    if not args:
        return None
    old = rng.choice(args)
    new = old + "_value"
    answer = re.sub(rf"\b{old}\b", new, text)
    head = answer.split("\n", 1)[0] + "\n"
    prompt = f"{text}\n\n\n# The same function, with `{old}` renamed to `{new}` throughout:\n{head}"
    return {"kind": "rename", "prompt": prompt, "answer": answer[len(head):]}


def quote_task(name, text, doc, module_source):
    """Quote the function back from a page of the file around it."""
    at = module_source.find(text)
    page = module_source[max(0, at - 1500) : at + len(text) + 1500]
    what = doc or f"is named {name}"
    head = text.split("\n", 1)[0] + "\n"
    prompt = f"{page}\n\n\n# The function above that {what[0].lower() + what[1:]}, quoted exactly:\n{head}"
    return {"kind": "quote", "prompt": prompt, "answer": text[len(head):]}


def line_task(name, text, rng):
    """Re-emit the function with one of its lines (not the first) changed."""
    lines = text.split("\n")
    body = [i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.strip().startswith(("#", '"'))]
    if not body:
        return None
    i = rng.choice(body)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    changed = f"{indent}pass  # was: {lines[i].strip()}"
    answer = "\n".join(lines[:i] + [changed] + lines[i + 1 :])
    head = lines[0] + "\n"
    prompt = (f"{text}\n\n\n# The same function, with line {i + 1} (`{lines[i].strip()}`) replaced by "
              f"`{changed.strip()}`:\n{head}")
    return {"kind": "line", "prompt": prompt, "answer": answer[len(head):]}


def tasks(count: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for module_name in MODULES:
        source, funcs = functions(module_name)
        rng.shuffle(funcs)
        for kind, (name, text, doc) in zip(("rename", "quote", "line"), funcs):
            task = (rename_task(name, text, rng) if kind == "rename" else quote_task(name, text, doc, source)
                    if kind == "quote" else line_task(name, text, rng))
            if task is not None:
                out.append({**task, "source": f"{module_name}.{name}"})
        if len(out) >= count:
            break
    return out[:count]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    ap.add_argument("--count", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    items = tasks(args.count, args.seed)
    with open(args.out, "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    print(f"wrote {len(items)} tasks from Python {sys.version.split()[0]}'s standard library to {args.out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
