"""The scripts under tools/ as modules, loaded in the test's process (a subprocess would spend seconds
importing MLX and the project again)."""

import importlib.util
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py, executed as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
