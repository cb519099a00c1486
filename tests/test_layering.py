"""Imports point one way: cli -> server -> {APIs} -> runtime -> speculative, playground -> runtime.

Every import in a module counts, including those inside functions (a lazy import is still an arrow).
Inside speculative/ the arrows form no cycle, and there are no more of them than UNITS (the flat layout had 68).
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


def engine_arrows() -> set:
    """(importer, imported) pairs between the modules of speculative/, each subpackage module its own node.

    `from pkg import mod` points at pkg.mod when that is a module; any other name points at the
    longest module prefix it names.
    """
    files = {module_name(f): f for f in modules("speculative")}
    arrows = set()
    for name, f in files.items():
        package = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    arrows.add((name, target))
    return arrows


def cycle(arrows: set) -> list:
    """One import cycle among `arrows` (as a list of modules), or [] when there is none."""
    graph = {}
    for a, b in arrows:
        graph.setdefault(a, []).append(b)
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_modules_are_where_the_layout_says():
    assert len(modules("speculative")) >= 8
    for package in ("speculative.prompt_cache", "speculative.measure", "speculative.heads", "speculative.draft_vocab",
                    "dyno_ui.cli", "dyno_ui.runtime", "dyno_ui.server", "dyno_ui.server.openai",
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
    allowed = ("dyno_ui.runtime", "dyno_ui.server.errors", "dyno_ui.server.streaming", "dyno_ui.server.drafting", api)
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


def test_the_engine_imports_have_no_cycle():
    """No module of speculative/ reaches itself through its imports, lazy ones included."""
    assert cycle(engine_arrows()) == []


def unit(module: str) -> str:
    """The unit a module belongs to: its subpackage of speculative/ (prompt_cache, measure, ...), else itself."""
    return ".".join(module.split(".")[:2])


FLAT_LAYOUT = 68  # the arrows between 27 flat modules, before units by role
# The arrows between the units today: 67 while the serial and batched rounds were two loops beside
# the acceptance rules, the sampling warp and the processors; 64 since round/ holds the one round,
# the rows' rules it runs and the depth policy (issue 37); 63 since one driver runs every width
# (engine -> batched -> round, batched no longer reaching up into engine); 65 since how deep a model
# drafts is decided once at load in its own unit above measure/ (depth.py: to measure, round and from
# the package, which no longer reaches measure itself). A change may only keep or lower it.
UNITS = 65


def test_the_engine_has_no_more_arrows_than_its_units_by_role():
    """The units by role (a subpackage is one unit, its inner arrows its own business) keep at most
    UNITS arrows between them, fewer than the flat layout's, whatever modules are added inside them."""
    arrows = {(unit(a), unit(b)) for a, b in engine_arrows() if unit(a) != unit(b)}
    assert UNITS < FLAT_LAYOUT
    assert len(arrows) <= UNITS, f"{len(arrows)} arrows between the units of speculative/:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(arrows))


def test_a_cycle_is_found():
    """The cycle check itself: a -> b -> c -> a is reported, a -> b, b -> c is not."""
    assert cycle({("a", "b"), ("b", "c"), ("c", "a")}) == ["a", "b", "c", "a"]
    assert cycle({("a", "b"), ("b", "c")}) == []
