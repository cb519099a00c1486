"""Real model shapes as data, and random checkpoints of them that Dyno loads like real ones."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5

from speculative.config import SamplingParams, SpecConfig
from speculative.heads.mtp import MTPHead
from speculative.loader import load_checkpoint
from tools.standin import shapes
from speculative.measure.bench import run_dyno, run_mlx_lm
from tools.standin.random_checkpoint import scaled_down, write_checkpoint

NOMINAL = {"0.8B": 0.8e9, "2B": 2e9, "4B": 4e9, "9B": 9e9, "27B": 27e9, "35B-A3B": 35e9}


@pytest.mark.parametrize("name", shapes.names())
def test_shape_builds_in_mlx_lm_with_its_parameter_count(name):
    record = shapes.load(name)
    assert record["source"] and record["repo"].startswith("Qwen/")
    config = record["text_config"]
    counted = shapes.parameter_count(config)
    model = qwen3_5.TextModel(qwen3_5.TextModelArgs.from_dict(config))  # lazy: shapes only
    trunk = sum(v.size for _, v in tree_flatten(model.parameters()))
    head = sum(v.size for _, v in tree_flatten(MTPHead(model.args).parameters()))
    assert (trunk, head) == (counted["total"] - counted["mtp_head"], counted["mtp_head"])
    # The name's size is the release's rounding (vision tower included): text params within 15%.
    assert abs(counted["total"] / NOMINAL[record["nominal_parameters"]] - 1) < 0.15
    assert config["vocab_size"] == 248320 and config["mtp_num_hidden_layers"] == 1
    assert config["layer_types"].count("full_attention") == config["num_hidden_layers"] // 4


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "qwen3.6-27b", "qwen3.6-35b-a3b"])
def test_random_checkpoint_round_trips_through_the_loader(tmp_path, name):
    config = scaled_down(shapes.load(name)["text_config"])
    folder = write_checkpoint(tmp_path, config, seed=2, shard_bytes=200_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and any(k.startswith("mtp.") for k in index)
    assert all(k.startswith(("model.language_model.", "mtp.", "lm_head.")) for k in index)
    lm = load_checkpoint(folder, mode="mtp")
    assert lm.head is not None
    # Zero-centred norms on disk, shifted by the loaders: effective weight 1.
    assert mx.allclose(lm.model.language_model.model.norm.weight, mx.ones(config["hidden_size"])).item()
    assert mx.allclose(lm.head.norm.weight, mx.ones(config["hidden_size"])).item()
    params = SamplingParams(max_tokens=24)
    plain = run_mlx_lm(lm, [3, 1, 4, 1, 5], params).tokens
    assert run_dyno(lm, [3, 1, 4, 1, 5], params, SpecConfig("mtp", 2, None)).tokens == plain
