"""Head loading: the +1 norm shift happens exactly once, and heads that do not fit are refused."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from helpers import tiny_models
from speculative.errors import DynoError
from speculative.loader import load_checkpoint
from speculative.heads.mtp import read_checkpoint_head, read_head_folder, write_head_folder
from speculative.heads.tensors import read_header, read_tensors

NORMS = ["pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
         "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
         "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"]


def raw_head_tensors(folder):
    shard = folder / "model-00002-of-00002.safetensors"
    names = [n for n in read_header(shard) if n.startswith("mtp.")]
    return {n[4:]: np.array(v) for n, v in read_tensors(shard, names).items()}


def loaded_head_params(lm):
    return {k: np.array(v) for k, v in tree_flatten(lm.head.parameters())}


def test_raw_checkpoint_norms_shifted_once(tiny_dir, tiny_lm):
    raw = raw_head_tensors(tiny_dir())
    params = loaded_head_params(tiny_lm())
    assert len(raw) == 15  # the dense head's 15 tensors
    for name, value in raw.items():
        want = value + 1.0 if name in NORMS else value
        np.testing.assert_array_equal(params[name], want.astype(np.float32), err_msg=name)


def test_head_folder_roundtrip_is_not_shifted_again(tiny_dir, tiny_lm, tmp_path):
    source = read_checkpoint_head(tiny_dir())
    assert source.norms_shifted is False
    folder = write_head_folder(tmp_path / "head", source, tiny_models.text_config())
    config = json.loads((folder / "config.json").read_text())
    assert config["format"] == "dyno-mtp-head" and config["norms_shifted"] is True
    again = read_head_folder(folder)
    assert again.norms_shifted is True
    lm = load_checkpoint(tiny_dir(), mtp_head=str(folder))
    assert lm.head_source == str(folder)
    expected = loaded_head_params(tiny_lm())
    for name, value in loaded_head_params(lm).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_mlx_checkpoint_that_kept_its_head(tiny_dir, tiny_lm, tmp_path):
    """An MLX conversion (sanitized conv1d) whose mtp.* norms were converted with the trunk."""
    lm = tiny_lm()
    out = tmp_path / "mlx"
    shutil.copytree(tiny_dir(), out, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = dict(tree_flatten(lm.model.parameters()))
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(lm.head.parameters())})
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    head = read_checkpoint_head(out)
    assert head.norms_shifted is None  # an MLX conversion: decided against the model at load
    reloaded = load_checkpoint(out)
    expected = loaded_head_params(lm)
    for name, value in loaded_head_params(reloaded).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_wrong_shapes_rejected(tiny_dir, tmp_path):
    other = tiny_models.build(tmp_path / "wide", seed=3, hidden_size=96)
    # Its config claims the model's shape, so the tensors' shapes are what gives it away (a config
    # that says 96 is refused before: tests/heads/test_graft.py).
    folder = write_head_folder(tmp_path / "head", read_checkpoint_head(other), tiny_models.text_config())
    with pytest.raises(DynoError) as e:
        load_checkpoint(tiny_dir(), mode="mtp", mtp_head=str(folder))
    assert e.value.message == (
        f"MTP head in {folder} does not fit this model: mtp.fc.weight has shape [96, 192], "
        f"the model needs [64, 128]"
    )
    lm = load_checkpoint(tiny_dir(), mode="auto", mtp_head=str(folder))  # auto: notice, plain decoding
    assert lm.head is None
    assert lm.notices == [f"dyno: decoding without drafts: {e.value.message}"]


def test_head_folder_missing_tensor(tiny_dir, tmp_path):
    head = read_checkpoint_head(tiny_dir())
    del head.tensors["layers.0.mlp.down_proj.weight"]
    folder = write_head_folder(tmp_path / "head", head, tiny_models.text_config())
    with pytest.raises(DynoError) as e:
        load_checkpoint(tiny_dir(), mode="mtp", mtp_head=str(folder))
    assert e.value.message == (
        f"MTP head in {folder} is missing tensors: mtp.layers.0.mlp.down_proj.weight"
    )
