"""Backend capability checks: probe what this MLX backend can do instead of assuming."""

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear


@lru_cache(maxsize=None)
def gather_mm_supports(dtype: mx.Dtype) -> bool:
    """Whether mx.gather_mm (the MoE expert matmul) runs in `dtype` on the default device.

    MLX's CPU backend (0.32) only has a float32 kernel; Metal and CUDA have bf16/fp16 ones.
    """
    a, b = mx.zeros((1, 1, 2), dtype=dtype), mx.zeros((1, 2, 2), dtype=dtype)
    try:
        mx.eval(mx.gather_mm(a, b, rhs_indices=mx.zeros((1,), dtype=mx.uint32)))
        return True
    except (RuntimeError, ValueError):
        return False


def widen_experts(module: nn.Module) -> set:
    """Cast unquantized MoE expert weights to float32 where this backend cannot multiply them in their
    own dtype (the portable fallback; elsewhere nothing changes). Returns the dtypes that were cast."""
    cast = set()
    for _, m in module.named_modules():
        if isinstance(m, SwitchLinear) and not gather_mm_supports(m.weight.dtype):
            cast.add(str(m.weight.dtype).replace("mlx.core.", ""))
            m.set_dtype(mx.float32)
    return cast
