"""Mixture-of-experts heads: both expert layouts load to the same head; mismatches are refused."""

import numpy as np
import pytest
from mlx.utils import tree_flatten

from helpers import tiny_models
from speculative.errors import DynoError
from speculative.loader import load_checkpoint
from speculative.heads.mtp import read_checkpoint_head, write_head_folder


def params(lm):
    return {k: np.array(v) for k, v in tree_flatten(lm.head.parameters())}


def test_expert_layouts_load_identically(tiny_lm):
    fused, per_expert = params(tiny_lm("moe-fused")), params(tiny_lm("moe-per-expert"))
    assert "layers.0.mlp.switch_mlp.gate_proj.weight" in fused
    assert fused["layers.0.mlp.switch_mlp.gate_proj.weight"].shape == (4, 32, 64)
    assert fused.keys() == per_expert.keys()
    for name in fused:  # same seed, same head: only the storage layout differs
        np.testing.assert_array_equal(fused[name], per_expert[name], err_msg=name)


def test_moe_head_norms_shifted_once(tiny_dir, tiny_lm):
    raw = read_checkpoint_head(tiny_dir("moe-fused"))
    assert len(raw.tensors) == 19 and raw.norms_shifted is False
    loaded = params(tiny_lm("moe-fused"))
    np.testing.assert_array_equal(loaded["norm.weight"], np.array(raw.tensors["norm.weight"]) + 1.0)
    np.testing.assert_array_equal(loaded["layers.0.mlp.shared_expert_gate.weight"],
                                  np.array(raw.tensors["layers.0.mlp.shared_expert_gate.weight"]))


def test_dense_head_on_moe_trunk_refused(tiny_dir, tmp_path):
    dense = write_head_folder(tmp_path / "dense", read_checkpoint_head(tiny_dir()), tiny_models.text_config())
    with pytest.raises(DynoError) as e:
        load_checkpoint(tiny_dir("moe-fused"), mode="mtp", mtp_head=str(dense))
    assert e.value.message == (f"MTP head in {dense} does not fit this model: the model is a "
                               f"mixture-of-experts model but the head is a dense head")


def test_wrong_expert_count_refused(tiny_dir, tmp_path):
    other = tiny_models.build(tmp_path / "e8", seed=7, moe=True, num_experts=8)
    folder = write_head_folder(tmp_path / "head", read_checkpoint_head(other), {})
    with pytest.raises(DynoError) as e:
        load_checkpoint(tiny_dir("moe-fused"), mode="mtp", mtp_head=str(folder))
    assert e.value.message == (f"MTP head in {folder} does not fit this model: mtp.layers.0.mlp.gate.weight "
                               f"has shape [8, 64], the model needs [4, 64]")


def test_bf16_experts_run_where_the_backend_has_no_bf16_kernel(tmp_path):
    """A bf16 MoE checkpoint decodes on every backend: where gather_mm has no bf16 kernel (MLX's CPU
    backend) the experts run in float32 with a notice; drafting still equals plain greedy."""
    import mlx.core as mx

    from helpers.reference import plain_greedy
    from speculative.backend import gather_mm_supports
    from speculative.config import SamplingParams, SpecConfig
    from speculative.engine import generate
    from speculative.events import Token

    folder = tiny_models.build(tmp_path / "moe", seed=7, moe=True, dtype=mx.bfloat16)
    lm = load_checkpoint(folder, mode="mtp")
    widened = not gather_mm_supports(mx.bfloat16)
    note = "dyno: MLX on this device has no bfloat16 kernel for MoE experts; running them in float32"
    assert (note in lm.notices) == widened
    expert = lm.head.layers[0].mlp.switch_mlp.gate_proj.weight
    assert expert.dtype == (mx.float32 if widened else mx.bfloat16)
    prompt = [5, 9, 13, 2]
    tokens = [e.id for e in generate(lm, prompt, SamplingParams(max_tokens=40), SpecConfig("mtp", 3))
              if isinstance(e, Token)]
    assert tokens == plain_greedy(lm, prompt, 40)
