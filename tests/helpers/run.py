"""The one way tests run Dyno as a user does: `python -m dyno_ui ...` (or any Python) in a subprocess
from the repository root, output captured as text, bounded in time."""

import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Path(sys.executable).parent / "mlx.launch"  # MLX's launcher, installed beside this Python


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


def free_ports(n: int = 2) -> int:
    """A first port such that it and the next n - 1 are free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            for p in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
    raise RuntimeError("no free ports")


def launched_dyno(*args: str, ranks: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """`mlx.launch` of `dyno *args` on `ranks` local ring-backend ranks (what a user runs across Macs,
    here on 127.0.0.1); the launcher's stdout is rank 0's."""
    cmd = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(ranks), "--starting-port",
           str(free_ports(ranks)), sys.executable, "-m", "dyno_ui", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
