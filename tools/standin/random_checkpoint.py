"""Seeded random checkpoints of real Qwen3.5/3.6 shapes, in the original Hugging Face layout.

Random weights of the right shape cost what trained ones cost, so the benchmark can time a 0.8B
or a 27B where the real weights cannot be downloaded. The layout is a raw HF release's, as the
bundled dyno-tiny's: trunk under `model.language_model.`, the MTP head as top-level `mtp.*`,
zero-centred norms, conv1d as [C, 1, K], fused MoE experts; so Dyno loads it through the same
conversions a real checkpoint takes. Tensors are made and written one shard at a time: a 2B bf16
(4 GB) never sits in memory whole.
"""

import copy
import json
import math
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5

from speculative.heads.mtp import NORM_RE, MTPHead

SHARD_BYTES = 1 << 30
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Trunk norms a raw HF checkpoint stores zero-centred (mlx-lm adds 1 back); the GDN output norm is plain.
_TRUNK_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


def write_tokenizer(folder: Path, max_length: int = 262144) -> None:
    """A byte-level BPE tokenizer (no merges) with Qwen-style special tokens and a chat template:
    prompts become ids, and ids beyond it are still valid model outputs (real vocabularies are
    padded too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": max_length}, indent=1))


def hf_tensors(text_config: dict) -> List[Tuple[str, tuple, Optional[mx.array]]]:
    """(HF name, shape, init or None) of every tensor: None for matrices (drawn at random when
    written), mlx-lm's own init (lazy, small) for vectors, already in the HF convention."""
    # A copy: mlx-lm's args rewrite rope_parameters in place, and the config is written out as given.
    model = qwen3_5.TextModel(qwen3_5.TextModelArgs.from_dict(copy.deepcopy(text_config)))  # lazy: nothing allocated
    out = []
    named = [(n, v, False) for n, v in tree_flatten(model.parameters())]
    named += [(n, v, True) for n, v in tree_flatten(MTPHead(model.args).parameters())]
    for name, v, head in named:
        shape = tuple(v.shape)
        hf = f"mtp.{name}" if head else (name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name)
        if ".switch_mlp." in hf:  # SwitchGLU -> the release's fused experts: gate_up [E, 2I, H], down [E, H, I]
            prefix, proj = hf.split(".switch_mlp.")
            if proj.startswith("up_proj"):
                continue
            if proj.startswith("gate_proj"):
                out.append((f"{prefix}.experts.gate_up_proj", (shape[0], 2 * shape[1], shape[2]), None))
            else:
                out.append((f"{prefix}.experts.down_proj", shape, None))
            continue
        if "conv1d.weight" in hf:
            out.append((hf, (shape[0], shape[2], shape[1]), None))  # mlx [C, K, 1] -> HF [C, 1, K]
            continue
        if v.ndim > 1:
            out.append((hf, shape, None))
            continue
        shifted = NORM_RE.match(name) if head else any(name.endswith(s) for s in _TRUNK_NORMS)
        out.append((hf, shape, v - 1.0 if shifted else v))
    return out


def write_checkpoint(folder, text_config: dict, seed: int = 0, dtype=mx.bfloat16,
                     shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a seeded random checkpoint of `text_config` to `folder` (raw HF layout, sharded with an
    index, the head in the last shard as releases put it); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(text_config)
    tensors.sort(key=lambda t: t[0].startswith("mtp."))  # the head last
    keys = mx.random.split(mx.random.key(seed), len(tensors))
    size = mx.zeros((), dtype).itemsize
    shards, current, nbytes = [], [], 0
    for i, t in enumerate(tensors):
        current.append((i, t))
        nbytes += math.prod(t[1]) * size
        if nbytes >= shard_bytes:
            shards.append(current)
            current, nbytes = [], 0
    if current:
        shards.append(current)
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        arrays = {}
        for i, (name, shape, init) in shard:
            if init is None:  # scale 1/sqrt(fan-in): activations stay O(1) through the random layers
                arrays[name] = mx.random.normal(shape, dtype=dtype, key=keys[i]) * (shape[-1] ** -0.5)
            else:
                arrays[name] = init.astype(dtype)
            weight_map[name] = file
        mx.save_safetensors(str(folder / file), arrays, metadata={"format": "pt"})
        del arrays  # one shard in memory at a time
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    moe = bool(text_config.get("num_experts"))
    # torch_dtype as releases write it: mlx-lm's convert casts to it, so a float32 model stays float32.
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
              "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text_config,
              "tie_word_embeddings": text_config["tie_word_embeddings"], "torch_dtype": dtype_name(dtype)}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(folder)
    return folder


def quantize(source: Path, folder: Path, bits: int, group_size: int = 64) -> Tuple[Path, Path]:
    """mlx-lm's convert of `source` at `bits` (it drops the head, as community conversions do) and the
    head as a standalone folder beside it, as Dyno re-attaches it: (model folder, head folder)."""
    from mlx_lm import convert

    from speculative.heads.mtp import read_checkpoint_head, write_head_folder

    model = folder / f"q{bits}g{group_size}"
    convert(hf_path=str(source), mlx_path=str(model), quantize=True, q_group_size=group_size, q_bits=bits)
    config = json.loads((source / "config.json").read_text())
    head = write_head_folder(folder / "head", read_checkpoint_head(source), config.get("text_config", config))
    return model, head


def dtype_name(dtype) -> str:
    """mlx.core.float32 -> "float32"."""
    return str(dtype).rsplit(".", 1)[-1]


def stamp(text_config: dict, seed: int, dtype) -> dict:
    """What a kept checkpoint was made from: written beside it last, so a whole folder has it."""
    return {"seed": seed, "dtype": dtype_name(dtype), "text_config": text_config}


def kept(folder: Path, text_config: dict, seed: int, dtype) -> bool:
    """True when `folder` holds a whole checkpoint write_checkpoint made for this config, seed and dtype."""
    try:
        return json.loads((folder / "dyno-random.json").read_text()) == stamp(text_config, seed, dtype)
    except (OSError, ValueError):
        return False


@contextmanager
def built(text_config: dict, bits: int = 16, seed: int = 0, root: Optional[str] = None,
          dtype=mx.bfloat16, keep: Optional[str] = None) -> Iterator[Tuple[Path, Optional[Path]]]:
    """(model folder, head folder or None) of a random checkpoint at `bits` (16: unquantized, in `dtype`,
    with the head inside; else quantized from it), in a temporary folder removed on exit, so one model
    at a time takes the disk. `keep` (16 bits only): that folder instead, left in place, and used as it
    is when an earlier run left the same checkpoint there (writing one takes minutes on a slow CPU)."""
    if keep is not None:
        if bits != 16:
            raise ValueError("keep applies to unquantized checkpoints")
        folder = Path(keep)
        if not kept(folder, text_config, seed, dtype):
            shutil.rmtree(folder, ignore_errors=True)
            write_checkpoint(folder, text_config, seed, dtype=dtype)
            (folder / "dyno-random.json").write_text(json.dumps(stamp(text_config, seed, dtype)))  # last: it is whole
        yield folder, None
        return
    tmp = Path(tempfile.mkdtemp(prefix="dyno-shape-", dir=root))
    try:
        source = write_checkpoint(tmp / dtype_name(dtype), text_config, seed, dtype=dtype)
        if bits == 16:
            yield source, None
        else:
            model, head = quantize(source, tmp, bits)
            shutil.rmtree(source)  # the quantized copy and the head are all a run needs
            yield model, head
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def scaled_down(text_config: dict, hidden: int = 64, layers: int = 4, vocab: int = 512) -> dict:
    """`text_config` with its widths cut down, keeping its kinds (tying, MoE, head ratios): for tests."""
    c = dict(text_config, hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, head_dim=16,
             linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=2 * hidden)
    c["num_attention_heads"] = max(1, text_config["num_attention_heads"] // 4)
    c["num_key_value_heads"] = max(1, text_config["num_key_value_heads"] // 4)
    c["linear_num_key_heads"] = max(1, text_config["linear_num_key_heads"] // 8)
    c["linear_num_value_heads"] = max(1, text_config["linear_num_value_heads"] // 8)
    if c.get("num_experts"):
        c.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    c["rope_parameters"] = dict(text_config["rope_parameters"], mrope_section=[2, 1, 1])
    c["layer_types"] = ["full_attention" if (i + 1) % c["full_attention_interval"] == 0 else "linear_attention"
                        for i in range(layers)]
    return c
