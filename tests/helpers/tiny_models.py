"""Tiny random Qwen3.5-family checkpoints in the original Hugging Face layout, for tests.

The model is built with mlx-lm's own classes (random init), then written the way a raw HF
release stores it: trunk under `model.language_model.`, `mtp.*` at the top level, zero-centred
norms, conv1d as [C, 1, K]. Loading it back exercises every conversion a real checkpoint needs.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5

from speculative.heads.mtp import MTPHead, NORM_RE
from tools.standin import random_checkpoint

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


VOCAB = 320  # 256 byte tokens + specials, padded like real vocabularies
_TRUNK_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


def text_config(**overrides) -> dict:
    """A small Qwen3.5 text config (8 layers: full attention at 3 and 7)."""
    cfg = dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6, vocab_size=VOCAB,
        tie_word_embeddings=True, max_position_embeddings=4096, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True},
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
    )
    cfg.update(overrides)
    cfg["layer_types"] = [
        "full_attention" if (i + 1) % cfg["full_attention_interval"] == 0 else "linear_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    return cfg


def _randomize_norms(params: dict, key) -> dict:
    """Non-trivial norms (effective weight 1 + small noise) so a missed or doubled shift shows."""
    out = {}
    for name, v in params.items():
        if v.ndim == 1 and name.endswith("norm.weight"):
            key, sub = mx.random.split(key)
            v = 1.0 + 0.2 * mx.random.normal(v.shape, key=sub)
        out[name] = v
    return out


def write_tokenizer(folder: Path) -> None:
    """The random checkpoints' tokenizer (byte-level BPE, Qwen-style specials, a chat template)."""
    random_checkpoint.write_tokenizer(folder, max_length=4096)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48, decoder_sparse_step=1, norm_topk_prob=True)


def _hf_experts(weights: dict, per_expert: bool) -> dict:
    """mlx-lm SwitchGLU names -> the HF layout: fused gate_up_proj/down_proj, or one by one."""
    out = {}
    for name, v in weights.items():
        if ".switch_mlp." not in name:
            out[name] = v
            continue
        prefix, proj = name.split(".switch_mlp.")
        proj = proj.split(".")[0]  # gate_proj / up_proj / down_proj
        if per_expert:
            for e in range(v.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}.weight"] = v[e]
        elif proj == "down_proj":
            out[f"{prefix}.experts.down_proj"] = v
        elif proj == "gate_proj":
            up = weights[name.replace("gate_proj", "up_proj")]
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
    return out


def build(folder, seed: int = 0, with_head: bool = True, dtype=mx.float32, wrapper: bool = True,
          generation_config: dict = None, moe: bool = False, head_experts: str = "fused",
          logit_scale: float = 1.0, **overrides) -> Path:
    """Write a random tiny checkpoint in raw HF layout to `folder`; returns the folder.

    moe=True builds a qwen3_5_moe model; head_experts is "fused" or "per-expert" (the head's
    expert layout; the trunk is always fused, as mlx-lm expects). logit_scale multiplies the
    final norm, hence the logits: random models are flat (top token ~3%); trained ones are not.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if moe:
        overrides = {**MOE, "model_type": "qwen3_5_moe_text", **overrides}
    tc = text_config(**overrides)
    key = mx.random.key(seed)
    mx.random.seed(seed)
    model = qwen3_5.TextModel(qwen3_5.TextModelArgs.from_dict(tc))
    params = _randomize_norms(dict(tree_flatten(model.parameters())), key)
    if logit_scale != 1.0:
        params["model.norm.weight"] = params["model.norm.weight"] * logit_scale
    weights = {}
    for name, v in params.items():
        if any(name.endswith(s) for s in _TRUNK_NORMS):
            v = v - 1.0  # HF stores zero-centred norms
        if "conv1d.weight" in name:
            v = v.moveaxis(2, 1)  # mlx [C, K, 1] -> HF [C, 1, K]
        hf = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        weights[hf if wrapper else name] = v.astype(dtype)
    weights = _hf_experts(weights, per_expert=False)
    if with_head:
        head = MTPHead(model.args)
        hp = _randomize_norms(dict(tree_flatten(head.parameters())), mx.random.split(key)[1])
        hp = _hf_experts(hp, per_expert=head_experts == "per-expert")
        for name, v in hp.items():
            weights[f"mtp.{name}"] = (v - 1.0 if NORM_RE.match(name) else v).astype(dtype)
    names = sorted(weights)
    # Two shards with an index, the head in the last one, like real releases.
    trunk = [n for n in names if not n.startswith("mtp.")]
    shards = {"model-00001-of-00002.safetensors": trunk[: len(trunk) // 2],
              "model-00002-of-00002.safetensors": trunk[len(trunk) // 2 :] + [n for n in names if n.startswith("mtp.")]}
    weight_map = {}
    for file, keys in shards.items():
        mx.save_safetensors(str(folder / file), {k: weights[k] for k in keys}, metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if wrapper:
        config = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
                  "model_type": "qwen3_5_moe" if moe else "qwen3_5",
                  "text_config": tc, "tie_word_embeddings": tc["tie_word_embeddings"]}
    else:
        config = dict(tc, architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    write_tokenizer(folder)
    return folder


def quantized(source, folder, group_size: int = 32, bits: int = 4):
    """An MLX-quantized conversion of checkpoint `source` (mlx_lm.convert, which drops the head)
    plus the head as a standalone folder; returns (model folder, head folder).

    group_size must divide the tiny dims (64, 128); scales keep the source dtype, so a bf16
    source gives bf16 logits, as community quantizations do.
    """
    return random_checkpoint.quantize(Path(source), Path(folder), bits, group_size)


def with_chat_template(model: Path, folder: Path, template: str) -> Path:
    """A copy of the checkpoint `model` in `folder` whose tokenizer has `template` as its chat template."""
    shutil.copytree(model, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), chat_template=template)))
    return folder
