"""The one way tests run Dyno as a user does: `python -m dyno_ui ...` (or any Python) in a subprocess
from the repository root, output captured as text, bounded in time."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Path(sys.executable).parent / "mlx.launch"  # MLX's launcher, installed beside this Python


@contextlib.contextmanager
def idle_stdin():
    """A stdin for mlx.launch that stays open and empty, as a terminal nobody types into.

    mlx.launch's main loop forwards its stdin to every rank: at end of input (a test's inherited
    /dev/null) select() never waits, and the loop spins on its queues' locks. A Ctrl-C landing just
    after such a lock was taken leaves it held, a rank's output thread blocks on it, and the launcher
    never exits (seen here: a group still running 60 s after SIGINT in 3 of 20 runs on two busy cores).
    """
    read, write = os.pipe()
    try:
        yield read
    finally:
        os.close(read)
        os.close(write)


def python(*args: str, env: Optional[Mapping[str, str]] = None, timeout: float = 300,
           cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python *args` with this interpreter; stdout and stderr as text."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(env) if env is not None else None, timeout=timeout)


def dyno(*args: str, env: Optional[Mapping[str, str]] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The `dyno` command with `args`."""
    return python("-m", "dyno_ui", *args, env=env, timeout=timeout)


# Each command as `python -m dyno_ui` runs it (SystemExit(main(argv))), its fds 1 and 2 sent to files,
# so whatever reaches the terminal is captured, MLX's C++ output included.
_MANY = """
import json, os, sys
argvs, out = json.load(open(sys.argv[1])), sys.argv[2]
results = []
for i, argv in enumerate(argvs):
    saved = os.dup(1), os.dup(2)
    paths = [f"{out}.{i}.stdout", f"{out}.{i}.stderr"]
    for fd, path in zip((1, 2), paths):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)
    try:
        from dyno_ui.cli import main
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    results.append([code] + [open(p, encoding="utf-8").read() for p in paths])
json.dump(results, open(out, "w"))
"""


def dyno_each(argvs: Sequence[Sequence[str]], env: Optional[Mapping[str, str]] = None,
              timeout: float = 300) -> List[subprocess.CompletedProcess]:
    """`dyno *argv` for each argv, one after another in one subprocess (one start-up, not one each):
    for commands that stop at an error before any model loads. Each result as `dyno`'s."""
    with tempfile.TemporaryDirectory() as tmp:
        argv_file, out = Path(tmp, "argvs.json"), Path(tmp, "results.json")
        argv_file.write_text(json.dumps([list(a) for a in argvs]))
        r = python("-c", _MANY, str(argv_file), str(out), env=env, timeout=timeout)
        assert r.returncode == 0 and not r.stdout and not r.stderr, r
        return [subprocess.CompletedProcess(["dyno", *argv], code, stdout, stderr)
                for argv, (code, stdout, stderr) in zip(argvs, json.loads(out.read_text()))]


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
    with idle_stdin() as stdin:
        return subprocess.run(cmd, cwd=ROOT, stdin=stdin, capture_output=True, text=True, timeout=timeout)
