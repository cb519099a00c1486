"""What every bit-for-bit test stands on: on this backend a row comes out the same computed alone or
with others (docs/how-it-works.md, Exactness on GPU backends; MLX's CUDA backend breaks it, measured on
an H200)."""

import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import batch_variance  # noqa: E402

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="row invariance holds on the CPU backend")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("inner, out, rows", [(64, 320, 2), (64, 320, 4), (1024, 4096, 3)])
def test_matmul_rows_together_equal_rows_alone(dtype, inner, out, rows):
    assert batch_variance.matmul_rows(dtype, inner, out, rows, mx.random.key(1)) == 0.0


def test_bundled_model_logits_together_equal_one_call_each():
    assert batch_variance.model_rows(str(ROOT / "assets" / "dyno-tiny")) == 0.0
