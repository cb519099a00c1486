"""Real Qwen3.5/3.6 model shapes as data: one JSON file per model, its figures and where they come from.

Random weights of the right shape cost what real ones cost, so these configs let the benchmark
build real-sized checkpoints where the real weights cannot be downloaded (random_checkpoint.py).
"""

import json
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).parent


def names() -> List[str]:
    """The shapes on file, e.g. qwen3.5-0.8b, qwen3.6-27b."""
    return sorted(p.stem for p in HERE.glob("*.json"))


def load(name: str) -> dict:
    """The record of shape `name`: repo, source, uncertain figures and the HF text_config."""
    path = HERE / f"{name}.json"
    if not path.exists():
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(names())}")
    return json.loads(path.read_text())


def _attention(c: dict) -> int:
    h, n, kv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    return h * 2 * n * d + 2 * h * kv * d + n * d * h + 2 * d  # q (with its gate), k, v, o; q/k norms


def _gated_deltanet(c: dict) -> int:
    h, nk, nv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    key, value = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    conv = 2 * key + value
    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm, out_proj
    return h * conv + h * value + 2 * h * nv + conv * c["linear_conv_kernel_dim"] + 2 * nv + c["linear_value_head_dim"] + value * h


def _mlp(c: dict) -> int:
    h = c["hidden_size"]
    if c.get("num_experts"):
        e, i, s = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
        return e * h + e * 3 * h * i + 3 * h * s + h  # router, experts, shared expert, its gate
    return 3 * h * c["intermediate_size"]


def parameter_count(text_config: dict) -> Dict[str, int]:
    """Parameters by part, counted from the config alone: embedding, lm_head (0 when tied), trunk
    layers, MTP head, and the text total (trunk + head + embeddings); no vision tower."""
    c = text_config
    h, v = c["hidden_size"], c["vocab_size"]
    layers = sum(_attention(c) if t == "full_attention" else _gated_deltanet(c) for t in c["layer_types"])
    layers += c["num_hidden_layers"] * (2 * h + _mlp(c)) + h  # two norms per layer, the final norm
    head = 2 * h * h + 3 * h + c.get("mtp_num_hidden_layers", 1) * (2 * h + _attention(c) + _mlp(c))
    embedding = v * h
    lm_head = 0 if c["tie_word_embeddings"] else v * h
    return {"embedding": embedding, "lm_head": lm_head, "layers": layers, "mtp_head": head,
            "total": embedding + lm_head + layers + head}
