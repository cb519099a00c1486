"""Which BLAS MLX's CPU products go through: named, with its file, in every benchmark record."""

import glob
import os
import subprocess
import sys

import pytest

from helpers.run import ROOT

from speculative.measure.blas import compute_bound_note, detect, name_of


def test_the_blas_is_named_with_the_file_mlx_calls():
    import mlx.core as mx

    mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))  # a float32 product: whatever BLAS there is, it is in use
    blas = detect()
    assert blas.name and os.path.isfile(blas.path)
    mapped = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
    assert any(os.path.realpath(m) == blas.path for m in mapped)
    assert blas.line().startswith(f"BLAS: {blas.name} ({blas.path})")
    if "mlx_cpu.libs" in blas.path:  # the wheel's own, not preloaded: the reference one, and the note says so
        assert blas.reference and blas.name == "reference BLAS (netlib, bundled with mlx[cpu])"
        assert compute_bound_note(blas).startswith("note: float32 products run compute-bound here")


def test_libraries_are_told_apart():
    assert name_of("/venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0") == (
        "reference BLAS (netlib, bundled with mlx[cpu])", True)
    assert name_of("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3") == ("reference BLAS (netlib)", True)
    assert name_of("/opt/intel/lib/libmkl_rt.so.2") == ("Intel MKL", False)
    assert name_of(None)[1] is False


OPENBLAS = sorted(glob.glob("/usr/lib/*/openblas-pthread/libopenblas.so.0"))


@pytest.mark.skipif(not OPENBLAS or not sys.platform.startswith("linux"), reason="no OpenBLAS installed")
def test_a_preloaded_openblas_is_the_one_named():
    """Preloaded, OpenBLAS replaces the bundled BLAS's symbols though both stay mapped."""
    code = "from speculative.measure.blas import detect; b = detect(); print(b.name); print(b.reference)"
    r = subprocess.run([str(ROOT / "tools/with_openblas.sh"), sys.executable, "-c", code], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "DYNO_OPENBLAS": OPENBLAS[0]}, timeout=60)
    assert r.returncode == 0, r.stderr
    name, reference = r.stdout.split("\n")[:2]
    assert name.startswith("OpenBLAS") and reference == "False"
