"""The engine never imports HTTP, UI or the user-facing package."""

import ast
from pathlib import Path

FORBIDDEN = {"gradio", "fastapi", "uvicorn", "pydantic", "starlette", "dyno_ui"}
ENGINE = Path(__file__).resolve().parent.parent / "speculative"


def imported_modules(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_engine_imports_no_http_or_ui():
    files = sorted(ENGINE.glob("*.py"))
    assert len(files) >= 8
    bad = [(f.name, m) for f in files for m in imported_modules(f) if m.split(".")[0] in FORBIDDEN]
    assert bad == []


def test_engine_does_not_print():
    calls = [f.name for f in ENGINE.glob("*.py")
             for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"]
    assert calls == []
