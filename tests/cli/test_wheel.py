"""A wheel, not only a checkout: installed into a fresh environment, `dyno generate` runs offline on the
bundled model and reads the data files the code ships (the release table, the playground's stylesheet)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from helpers.run import ROOT, dyno

pytestmark = pytest.mark.e2e

PROMPT = "def add(a, b):"


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)


def test_an_installed_wheel_generates_offline_with_the_bundled_model(tmp_path):
    # From a copy: a build in the checkout leaves build/ there, whose stale files would hide a missing rule.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "tests", "docs", "tools", "screenshots", "bench",
        "dyno-tiny-*"))
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                tmp_path / "dist", source)
    assert built.returncode == 0, built.stderr
    wheel, = (tmp_path / "dist").glob("*.whl")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    # Only the wheel goes into the fresh environment; its dependencies come from this one's
    # site-packages on PYTHONPATH (.pth files there, the checkout's editable hook among them, are not read).
    target = run(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    installed = run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--prefix", env_dir, wheel)
    assert installed.returncode == 0, installed.stderr
    env = {**os.environ, "PYTHONPATH": sysconfig.get_path("purelib"), "HF_HUB_OFFLINE": "1"}
    env.pop("DYNO_MODEL", None)
    where = run(py, "-c", "import dyno_ui.paths as p, speculative.heads.find as f, json; "
                "print(json.dumps([str(p.BUNDLED_MODEL), len(f.releases()), p.ASSETS.joinpath('dyno.css').is_file()]))",
                cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    bundled, releases, css = json.loads(where.stdout)
    assert Path(bundled).is_relative_to(env_dir) and Path(target).is_relative_to(env_dir)
    assert releases > 0 and css
    got = run(py, "-m", "dyno_ui", "generate", "--prompt", PROMPT, "--max-tokens", "16", "--temp", "0", "--json",
              cwd=tmp_path, env=env)
    assert got.returncode == 0, got.stderr
    want = dyno("generate", "--prompt", PROMPT, "--max-tokens", "16", "--temp", "0", "--json")
    assert json.loads(got.stdout)["tokens"] == json.loads(want.stdout)["tokens"]
