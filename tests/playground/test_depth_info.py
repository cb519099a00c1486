"""The playground's depth sliders say, on Metal, where a verify leaves the vector attention kernel."""

from pathlib import Path

from speculative import load_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_playground_depth_slider_says_where_the_kernel_ends_on_metal():
    from dyno_ui.playground.ui import depth_info

    lm, _ = load_model(ROOT / "assets" / "dyno-tiny", draft_depth=1)
    assert depth_info(lm, metal=False) is None
    assert depth_info(lm, metal=True) == ("above 7, a verify leaves Metal's vector attention kernel for this model "
                                          "(docs/performance.md)")
