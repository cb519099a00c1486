"""Shared fixtures: tiny random checkpoints built once per session (helpers/ holds everything else)."""

import atexit
import os
import shutil
import tempfile

# Before MLX's first op: float32 products of several rows run at TF32 precision by default on CUDA
# and M5-class Metal while one row stays float32, so the verify pass would round unlike plain
# decoding (docs/how-it-works.md, Exactness on GPU backends). MLX's own tests pin it the same way.
os.environ["MLX_ENABLE_TF32"] = "0"

# MLX's CPU backend compiles fused kernels with the C++ compiler into $TMPDIR/mlx/<version>/cpu, a
# file per kernel written in place: two pytest-xdist workers (pyproject's addopts) that need the same
# new kernel at once could read each other's half-written source or library. Each worker, and the
# subprocesses it starts, gets a temporary folder of its own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _worker_tmp = os.path.join(tempfile.gettempdir(), f"dyno-tests-{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(_worker_tmp, exist_ok=True)
    os.environ["TMPDIR"] = _worker_tmp
    tempfile.tempdir = None  # tempfile looks again (DYNO_CACHE below lands in the worker's folder)

import mlx.core as mx
import pytest

# The exactness tests compare bits, which hold on MLX's CPU backend alone (docs/how-it-works.md,
# Exactness on GPU backends): the suite runs there, and so do the processes it starts (DYNO_DEVICE),
# unless DYNO_TEST_DEVICE=gpu asks for the GPU; then only the tests marked `gpu` run.
TEST_DEVICE = os.environ.get("DYNO_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "gpu"):
    raise pytest.UsageError(f"DYNO_TEST_DEVICE must be cpu or gpu, not {TEST_DEVICE!r}")
if not mx.is_available(getattr(mx, TEST_DEVICE)):
    raise pytest.UsageError(f"DYNO_TEST_DEVICE={TEST_DEVICE}: this MLX has no {TEST_DEVICE} backend")
os.environ["DYNO_DEVICE"] = TEST_DEVICE
mx.set_default_device(getattr(mx, TEST_DEVICE))

from helpers import tiny_models
from helpers.tiny_models import CONFIGS
from speculative.loader import load_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ["DYNO_CACHE"] = tempfile.mkdtemp(prefix="dyno-test-cache-")  # never the user's cache
atexit.register(shutil.rmtree, os.environ["DYNO_CACHE"], True)  # (each test process makes its own)

@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Folder of a tiny random checkpoint for each config name (built lazily, cached)."""
    built = {}

    def get(name="tied-gqa2", **extra):
        key = (name, tuple(sorted(extra.items())))
        if key not in built:
            cfg = dict(CONFIGS[name], **extra)
            built[key] = tiny_models.build(tmp_path_factory.mktemp(name), **cfg)
        return built[key]

    return get


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory):
    """Folder of the tiny Qwen3.5-VL checkpoint (helpers/vision_models.py); skipped without mlx-vlm."""
    pytest.importorskip("mlx_vlm", reason="images need mlx-vlm (pip install 'dyno-mlx[vision]')")
    from helpers import vision_models

    return vision_models.build(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_dir):
    """Loaded tiny model per config name (cached)."""
    loaded = {}

    def get(name="tied-gqa2", mode="auto"):
        if (name, mode) not in loaded:
            loaded[(name, mode)] = load_checkpoint(tiny_dir(name), mode=mode)
        return loaded[(name, mode)]

    return get


def pytest_collection_modifyitems(config, items):
    """Test files with a `slow` test run first, the rest in their usual order after them: pytest-xdist
    hands whole files to its two workers in this order, so the long ones overlap from the start and
    short files fill the end (a long file last keeps one worker busy while the other waits)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
    if TEST_DEVICE == "gpu":
        bit_exact = pytest.mark.skip(reason="compares bits: runs on the CPU device (DYNO_TEST_DEVICE unset)")
        for item in items:
            if not item.get_closest_marker("gpu"):
                item.add_marker(bit_exact)


@pytest.fixture
def metal_kernel(monkeypatch):
    """Metal's Gated DeltaNet branch on this machine (helpers/metal.py): the stand-in kernel mlx-lm calls."""
    from helpers.metal import emulate

    return emulate(monkeypatch)
