"""Shared fixtures: tiny random checkpoints built once per session, and reference decoding."""

import os
import tempfile

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import tiny_models
from speculative.loader import load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ["DYNO_CACHE"] = tempfile.mkdtemp(prefix="dyno-test-cache-")  # never the user's cache

# Configs that vary what the engine must get right: tying, GQA ratio, GDN head ratio, wrapper.
# Seeds are ones whose greedy text runs 200 tokens without hitting EOS.
CONFIGS = {
    "tied-gqa2": dict(seed=1),
    "untied-mha": dict(seed=10, tie_word_embeddings=False, num_key_value_heads=4),
    "gqa4-gdn1to1": dict(seed=11, num_key_value_heads=1, linear_num_value_heads=2, num_hidden_layers=8),
    "text-only": dict(seed=4, wrapper=False, linear_num_key_heads=1, linear_num_value_heads=4),
    "moe-fused": dict(seed=7, moe=True),
    "moe-per-expert": dict(seed=7, moe=True, head_experts="per-expert", wrapper=False),
}


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
def tiny_lm(tiny_dir):
    """Loaded tiny model per config name (cached)."""
    loaded = {}

    def get(name="tied-gqa2", mode="auto"):
        if (name, mode) not in loaded:
            loaded[(name, mode)] = load_model(tiny_dir(name), mode=mode)
        return loaded[(name, mode)]

    return get


def plain_greedy(lm, prompt, n, prefill_step=2048, stop_at_eos=True):
    """mlx-lm's own greedy decoding (cut after EOS): the reference speculative runs must equal."""
    out = []
    for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n, prefill_step_size=prefill_step):
        out.append(int(t))
        if stop_at_eos and out[-1] in lm.eos_token_ids:
            break
    return out
