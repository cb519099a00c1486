"""The one way tests run Dyno as a user does: `python -m dyno_ui ...` (or any Python) in a subprocess
from the repository root, output captured as text, bounded in time."""

import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional

ROOT = Path(__file__).resolve().parents[2]


def python(*args: str, env: Optional[Mapping[str, str]] = None, timeout: float = 300,
           cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python *args` with this interpreter; stdout and stderr as text."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(env) if env is not None else None, timeout=timeout)


def dyno(*args: str, env: Optional[Mapping[str, str]] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The `dyno` command with `args`."""
    return python("-m", "dyno_ui", *args, env=env, timeout=timeout)


def dyno_server(*args: str, env: Optional[Mapping[str, str]] = None) -> subprocess.Popen:
    """`dyno serve *args` left running, its stdout and stderr piped as text (the caller stops it)."""
    return subprocess.Popen([sys.executable, "-m", "dyno_ui", "serve", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(env) if env is not None else None)
