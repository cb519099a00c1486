"""Write dyno-tiny in the original Hugging Face layout of a Qwen3.5 release, plus its golden file."""

from __future__ import annotations

import json
import pathlib

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from tiny_data import SPECIAL_TOKENS, write_json
from tiny_model import TinyMTPModel, TinyShape

REPO_ID = "dyno-project/dyno-tiny"
MLX_REPO_ID = "dyno-project/dyno-tiny-mlx"


def repo_ids(moe: bool) -> tuple[str, str]:
    """(original, MLX conversion) repo ids of the dense or the mixture-of-experts variant."""
    return (REPO_ID + "-moe", MLX_REPO_ID.replace("-mlx", "-moe-mlx")) if moe else (REPO_ID, MLX_REPO_ID)

# A placeholder vision tower (random, untrained), so the checkpoint has a real release's `model.visual.*`
# keys and `vision_config`, which text loaders must skip. Images are not supported.
VISION = dict(depth=1, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
              in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=64, initializer_range=0.02)

CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is true %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


def token_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t, _ in SPECIAL_TOKENS}


def hf_config(model: TinyMTPModel, shape: TinyShape, ids: dict[str, int]) -> dict:
    """config.json shaped like Qwen3_5ForConditionalGeneration releases (text_config + vision_config)."""
    c = model.config
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "eos_token_id": ids["<|endoftext|>"],
        "full_attention_interval": 4,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "hidden_size": c.hidden_size,
        "initializer_range": c.initializer_range,
        "intermediate_size": getattr(c, "intermediate_size", None),
        "layer_types": list(c.layer_types),
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "linear_key_head_dim": c.linear_key_head_dim,
        "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads,
        "linear_value_head_dim": c.linear_value_head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "model_type": "qwen3_5_moe_text" if model.moe else "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": dict(c.rope_parameters),
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": c.vocab_size,
    }
    family = "qwen3_5_moe" if model.moe else "qwen3_5"
    if model.moe:
        del text["intermediate_size"]
        text.update({k: getattr(c, k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                 "shared_expert_intermediate_size", "router_aux_loss_coef")})
    vision = {"model_type": family, **VISION, "out_hidden_size": c.hidden_size}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if model.moe else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"],
        "model_type": family,
        "text_config": text,
        "tie_word_embeddings": True,
        "transformers_version": transformers.__version__,
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }


def vision_state(hidden_size: int, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    vcfg = Qwen3_5VisionConfig(**VISION, out_hidden_size=hidden_size)
    return {f"model.visual.{k}": v for k, v in Qwen3_5VisionModel(vcfg).state_dict().items()}


def checkpoint_tensors(model: TinyMTPModel, seed: int) -> dict[str, torch.Tensor]:
    """All tensors under their release names, bf16; norms stay zero-centred as the torch modules hold them."""
    out = {}
    for k, v in model.lm.state_dict().items():
        if k == "lm_head.weight":
            continue  # tied to embed_tokens, as in the small Qwen3.5 releases
        assert k.startswith("model."), k
        out["model.language_model." + k[len("model.") :]] = v
    out.update({f"mtp.{k}": v for k, v in model.mtp.state_dict().items()})
    out.update(vision_state(model.config.hidden_size, seed))
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def write_shards(tensors: dict[str, torch.Tensor], out: pathlib.Path, n_shards: int = 2) -> None:
    """model.safetensors-0000i-of-0000n.safetensors + index; the last shard ends with the `mtp.*` tensors."""
    trunk = sorted(k for k in tensors if not k.startswith("mtp."))
    mtp = sorted(k for k in tensors if k.startswith("mtp."))
    half = len(trunk) // 2
    groups = [trunk[:half], trunk[half:] + mtp] if n_shards == 2 else [trunk + mtp]
    weight_map, total = {}, 0
    for i, keys in enumerate(groups, 1):
        name = f"model.safetensors-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(out / name), metadata={"format": "pt"})
        for k in keys:
            weight_map[k] = name
            total += tensors[k].numel() * tensors[k].element_size()
    params = sum(t.numel() for t in tensors.values())
    write_json(out / "model.safetensors.index.json",
               {"metadata": {"total_parameters": params, "total_size": total},
                "weight_map": dict(sorted(weight_map.items()))})


def write_tokenizer(tok: Tokenizer, out: pathlib.Path) -> None:
    """tokenizer.json (+ vocab.json/merges.txt like Qwen repos) and a Qwen-style tokenizer_config.json."""
    tok.save(str(out / "tokenizer.json"))
    spec = json.loads(tok.to_str())
    write_json(out / "vocab.json", spec["model"]["vocab"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    decoder = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": s}
        for t, s in SPECIAL_TOKENS
    }
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                                      "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
                                      "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                      "<|video_pad|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })


def write_generation_config(out: pathlib.Path, ids: dict[str, int]) -> None:
    write_json(out / "generation_config.json", {
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": transformers.__version__,
    })


def bf16_rounded(model: TinyMTPModel) -> TinyMTPModel:
    """An fp32 copy of the model whose weights are exactly the exported bf16 values."""
    import copy

    ref = copy.deepcopy(model).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return ref


@torch.no_grad()
def write_golden(model: TinyMTPModel, input_ids: torch.Tensor, out: pathlib.Path, depth: int = 3) -> dict:
    """golden.safetensors: fp32 reference logits of the exported (bf16) weights on a fixed input.

    trunk_logits[p] / trunk_hidden[p]: trunk at position p (hidden after the final norm).
    head_tokens[p] = t_{p+1} (the last row uses next_token = argmax trunk_logits[-1]), head_logits[p] and
    head_hidden[p] (after mtp.norm): the head on (head_tokens[p], trunk_hidden[p]) at RoPE position p,
    scoring t_{p+2}. chain_*: a recursive greedy draft from the last row, depth 1..3 (positions L-1..L+1).
    """
    ref = bf16_rounded(model)
    ids = input_ids[None]
    logits, hidden = ref.trunk(ids)
    next_token = logits[0, -1].argmax()
    head_tokens = torch.cat([ids[0, 1:], next_token[None]])
    head_logits, head_hidden = ref.head_chain(hidden, [head_tokens[None]] * depth, greedy_tail=True)
    chain_logits = torch.stack([lg[0, -1] for lg in head_logits])
    chain_tokens = torch.cat([next_token[None], chain_logits.argmax(-1)])
    tensors = {
        "input_ids": ids[0].to(torch.int64),
        "next_token": next_token[None].to(torch.int64),
        "trunk_logits": logits[0].float(),
        "trunk_hidden": hidden[0].float(),
        "head_tokens": head_tokens.to(torch.int64),
        "head_logits": head_logits[0][0].float(),
        "head_hidden": head_hidden[0][0].float(),
        "chain_tokens": chain_tokens.to(torch.int64),  # [next_token, d1, d2, d3]
        "chain_logits": chain_logits.float(),  # [depth, V]: row j scores d_{j+1}
    }
    meta = {
        "description": "dyno-tiny reference (transformers, fp32 compute on the exported bf16 weights)",
        "alignment": "head row p: token t_{p+1}, trunk hidden h_p (post final norm), RoPE position p, predicts t_{p+2}",
        "chain": "depth j>1 feeds d_{j-1} and the head's own post-mtp.norm hidden at position L-1+j-1",
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "golden.safetensors"), metadata=meta)
    return {"input_len": int(ids.shape[1]), "chain_tokens": chain_tokens.tolist()}
