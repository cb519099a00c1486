"""Metal's attention dispatch rule, and the notice when a draft depth leaves its vector kernel."""

from pathlib import Path

from speculative import attention_kernels, load_model
from speculative.attention_kernels import deepest_vector_depth, depth_notice, metal_attention_kernel
from tools.standin import shapes

ROOT = Path(__file__).resolve().parents[2]


def test_metal_vector_kernel_depth_follows_rows_and_gqa():
    # rows x GQA factor <= 32 and rows <= 8: the 27B (24/4 heads) keeps the vector kernel to depth 4,
    # the 35B-A3B (16/2) to depth 3, the 0.8B (8/2) to depth 7.
    assert deepest_vector_depth(shapes.load("qwen3.6-27b")["text_config"]) == 4
    assert deepest_vector_depth(shapes.load("qwen3.6-35b-a3b")["text_config"]) == 3
    c = shapes.load("qwen3.5-0.8b")["text_config"]
    assert deepest_vector_depth(c) == 7
    assert metal_attention_kernel(c, 8) == "vector" and metal_attention_kernel(c, 9) == "unfused"


def test_the_notice_is_for_metal_and_for_depths_past_the_kernel():
    c = shapes.load("qwen3.6-27b")["text_config"]
    assert depth_notice(c, 5, metal=True) == (
        "draft depth 5 verifies 6 query rows: past Metal's vector attention kernel for this model (at most 5 "
        "rows), so its attention runs unfused; depth 4 is the deepest on it")
    assert depth_notice(c, 4, metal=True) is None
    assert depth_notice(c, 5, metal=False) is None
    # A head dim the vector kernel lacks: a plain step is unfused too, so drafting deeper changes nothing.
    assert depth_notice({**c, "head_dim": 80}, 5, metal=True) is None


def test_loading_at_a_depth_past_the_kernel_says_so_on_metal(monkeypatch):
    """The bundled model (3/1 heads, head dim 64) keeps the vector kernel to depth 7; at 8 the notice
    reaches load_model's notify, on Metal only."""
    notices = []
    load_model(ROOT / "assets" / "dyno-tiny", draft_depth=8, notify=notices.append)
    assert not any("vector attention kernel" in n for n in notices)
    monkeypatch.setattr(attention_kernels, "on_metal", lambda: True)
    notices = []
    lm, spec = load_model(ROOT / "assets" / "dyno-tiny", draft_depth=8, notify=notices.append)
    assert spec.draft_depth == 8
    assert notices[-1] == ("warning: draft depth 8 verifies 9 query rows: past Metal's vector attention kernel for "
                           "this model (at most 8 rows), so its attention runs unfused; depth 7 is the deepest on it")
    notices = []
    load_model(ROOT / "assets" / "dyno-tiny", draft_depth=7, notify=notices.append)
    assert not any("vector attention kernel" in n for n in notices)

