"""Which attention kernel a verify pass takes on Metal, and the notice when a draft depth leaves the fast one.

MLX's Metal dispatch (mlx/backend/metal/scaled_dot_product_attention.cpp, has_fused_kernel and
use_fallback, read at ml-explore/mlx commit 00703ea): up to 8 query rows take the fused vector
kernel when the head dim is one it has and rows x GQA factor <= 32; more rows at head dim 256 take
the unfused ops. A verify of k drafts has k+1 query rows. MLX's CPU backend always takes the unfused
ops, and CUDA has its own rule, so the notice is for Metal alone. Not measured here: what leaving
the kernel costs on a Mac (docs/performance.md).
"""

from typing import Optional

import mlx.core as mx

VECTOR_MAX_ROWS, VECTOR_MAX_ROWS_X_GQA = 8, 32
VECTOR_HEAD_DIMS = (64, 96, 128, 192, 256, 512)


def metal_attention_kernel(text_config: dict, rows: int) -> str:
    """Which attention path a `rows`-query pass (a verify of rows - 1 drafts) takes on Metal."""
    gqa = text_config["num_attention_heads"] // text_config["num_key_value_heads"]
    d = text_config["head_dim"]
    if rows <= VECTOR_MAX_ROWS and d in VECTOR_HEAD_DIMS and rows * gqa <= VECTOR_MAX_ROWS_X_GQA:
        return "vector"
    return "unfused"


def deepest_vector_depth(text_config: dict) -> int:
    """The deepest draft depth whose verify (depth + 1 rows) keeps Metal's vector kernel."""
    return max((k for k in range(0, VECTOR_MAX_ROWS) if metal_attention_kernel(text_config, k + 1) == "vector"), default=0)


def on_metal() -> bool:
    """True when MLX computes on a Metal GPU (a CUDA build reports a GPU too, without Metal)."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def depth_notice(text_config: dict, depth: int, metal: Optional[bool] = None) -> Optional[str]:
    """One line when a verify at `depth` leaves Metal's vector kernel that a plain step (one row) takes;
    None elsewhere, or off Metal (`metal`: the backend, else detected)."""
    if not (on_metal() if metal is None else metal):
        return None
    if metal_attention_kernel(text_config, 1) != "vector" or metal_attention_kernel(text_config, depth + 1) == "vector":
        return None
    deepest = deepest_vector_depth(text_config)
    return (f"draft depth {depth} verifies {depth + 1} query rows: past Metal's vector attention kernel for this "
            f"model (at most {deepest + 1} rows), so its attention runs unfused; depth {deepest} is the deepest on it")
