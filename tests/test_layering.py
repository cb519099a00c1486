"""Imports point one way: cli -> server -> {APIs} -> runtime -> speculative, playground -> runtime.

Every import in a module counts, including those inside functions (a lazy import is still an arrow).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WEB = {"gradio", "fastapi", "uvicorn", "pydantic", "starlette"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path):
    """Absolute names of everything `path` imports (relative imports resolved)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                yield module
            else:  # `from . import x`: each name is a module of the package
                yield from (f"{module}.{a.name}" for a in node.names)


def modules(package: str):
    folder = ROOT / package.replace(".", "/")
    return sorted(folder.rglob("*.py"))


def violations(package: str, forbidden) -> list:
    """(module, import) pairs in `package` where forbidden(import) is true."""
    return [(module_name(f), name) for f in modules(package) for name in imports(f) if forbidden(name)]


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_modules_are_where_the_layout_says():
    assert len(modules("speculative")) >= 8
    for package in ("dyno_ui.cli", "dyno_ui.runtime", "dyno_ui.server", "dyno_ui.server.openai",
                    "dyno_ui.server.anthropic", "dyno_ui.playground"):
        assert (ROOT / package.replace(".", "/") / "__init__.py").exists(), package


def test_engine_imports_no_http_ui_or_dyno_ui():
    assert violations("speculative", lambda n: n.split(".")[0] in WEB | {"dyno_ui"}) == []


def test_runtime_imports_no_web_framework_and_nothing_above_it():
    assert violations("dyno_ui.runtime", lambda n: n.split(".")[0] in WEB or under(
        n, "dyno_ui.cli", "dyno_ui.server", "dyno_ui.playground", "dyno_ui.options")) == []


@pytest.mark.parametrize("api", ["dyno_ui.server.openai", "dyno_ui.server.anthropic"])
def test_an_api_imports_only_the_runtime_and_the_servers_shared_helpers(api):
    """Not the engine either: an API hands the runtime one ChatRequest (runtime/request.py)."""
    allowed = ("dyno_ui.runtime", "dyno_ui.server.errors", "dyno_ui.server.streaming", api)
    assert violations(api, lambda n: under(n, "dyno_ui", "speculative") and not under(n, *allowed)) == []


# Request fields of the OpenAI and Anthropic APIs: the APIs translate them, the engine reads its own specs.
WIRE_NAMES = ("response_format", "input_schema", "tool_choice", "output_config", "OpenAI", "Anthropic")


def test_the_grammar_engine_knows_no_api_shapes():
    source = (ROOT / "speculative/constraints.py").read_text()
    assert [w for w in WIRE_NAMES if w in source] == []
    strings = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert strings & {"function", "tool", "any", "auto", "none"} == set()  # tool shapes and tool_choice forms


def test_the_server_never_imports_the_cli():
    assert violations("dyno_ui.server", lambda n: under(n, "dyno_ui.cli")) == []


def test_the_servers_shared_helpers_import_no_api():
    shared = [ROOT / "dyno_ui/server/errors.py", ROOT / "dyno_ui/server/streaming.py"]
    bad = [(f.name, n) for f in shared for n in imports(f)
           if under(n, "dyno_ui.server.openai", "dyno_ui.server.anthropic", "dyno_ui.server.app")]
    assert bad == []


def test_the_playground_goes_through_the_runtime_only():
    assert violations("dyno_ui.playground", lambda n: under(n, "dyno_ui.cli", "dyno_ui.server")) == []


def test_nothing_in_the_package_imports_the_cli():
    outside = [p for p in ("speculative", "dyno_ui.runtime", "dyno_ui.server", "dyno_ui.playground")]
    bad = [v for p in outside for v in violations(p, lambda n: under(n, "dyno_ui.cli"))]
    bad += [("dyno_ui.options", n) for n in imports(ROOT / "dyno_ui/options.py") if under(n, "dyno_ui.cli")]
    assert bad == []


def test_rendering_helpers_load_without_mlx_or_gradio():
    """The trace, its HTML and its charts are plain Python: no MLX, no Gradio (the worker's outputs alone)."""
    code = ("import sys; import dyno_ui.playground.render, dyno_ui.playground.charts; "
            "print(sorted(m for m in ('mlx', 'mlx.core', 'gradio', 'fastapi') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_engine_does_not_print():
    calls = [f.name for f in modules("speculative")
             for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"]
    assert calls == []
