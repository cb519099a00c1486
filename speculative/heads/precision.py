"""How precisely the MTP head is kept in memory: the policy, quantizing at load, and its bytes.

The cache keeps the head's downloaded bf16 tensors (the source of truth, good for any precision);
the precision is applied when the head is built, with MLX's affine quantization, which is
deterministic: the same tensors and bits give the same head, bit for bit.

Quantized: the head's own linear layers (fc, the attention projections, the dense MLP or the MoE
head's shared expert). Kept as they are: every norm, a MoE head's experts (quantized MoE heads
are reported to collapse acceptance, 5-11% against 79-85%), its router and shared-expert gate, and
any layer whose input width the group size does not divide.
"""

from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import DynoError

HEAD_BITS = (16, 8, 4)  # 16: as stored (bf16, or the checkpoint's float dtype)
GROUP_SIZE = 64
# Default with a quantized trunk, per backend (docs/heads.md, "Head memory"; the speeds in
# docs/performance.md, "Head precision"). CPU: MLX 0.32.4's quantized matmul is slower than bf16
# there: the bundled model's draft step 3.1-3.4x, one row through the 27B head's shapes ~9x
# (`python tools/head_precision.py [--linears-27b]`), so the CPU keeps the stored precision.
# GPU (Metal, CUDA): 8-bit, from reported figures (a 27B head 0.85 -> 0.45 GB, acceptance within a
# point of bf16), not measured here.
QUANTIZED_TRUNK_DEFAULT = {"cpu": 16, "gpu": 8}
# The text_config values a head's shapes depend on, shared by Qwen3.5-27B, Qwen3.6-27B and
# Qwen3.8-27B (mtp-reference.md; intermediate_size 17408 from their config.json): the published
# sizes that the byte table in docs/heads.md and its test are computed for.
QWEN_27B = dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                rms_norm_eps=1e-6, tie_word_embeddings=False, mtp_num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25})


def parse_head_bits(value) -> Optional[int]:
    """--mtp-head-bits as given (16, 8, 4, "auto" or None) -> bits, or None for the default."""
    if value is None or value == "auto":
        return None
    try:
        bits = int(value)
    except (TypeError, ValueError):
        bits = None
    if bits not in HEAD_BITS or isinstance(value, (bool, float)):
        raise DynoError(f"--mtp-head-bits must be 16, 8, 4 or auto, got {value!r}")
    return bits


def default_head_bits(trunk_quantization: Optional[dict], device=None) -> int:
    """The head follows the trunk: stored precision with a float trunk; with a quantized one, the
    backend's choice (QUANTIZED_TRUNK_DEFAULT)."""
    if not trunk_quantization:
        return 16
    kind = getattr(device or mx.default_device(), "type", device)  # a Device or a DeviceType
    return QUANTIZED_TRUNK_DEFAULT["cpu" if kind == mx.cpu else "gpu"]


def head_bits(requested, trunk_quantization: Optional[dict], device=None) -> int:
    """The bits the head is kept at: the request, else the default for this trunk and backend."""
    bits = parse_head_bits(requested)
    return default_head_bits(trunk_quantization, device) if bits is None else bits


def stored_quantization(quantization: Optional[dict], path: str, module: nn.Module, tensors: dict,
                        prefixes=()) -> Union[bool, dict]:
    """How the head's module at `path` was stored, as mlx-lm loads a conversion: its per-module
    entry in config.json's `quantization` (under any of `prefixes` + path; `false`: kept float),
    else what its packed shapes and scale dtype say (affine, mxfp4, nvfp4, mxfp8); False when the
    tensors hold no scales for it. Raises ValueError on packing that fits no mode."""
    from mlx_lm.utils import infer_quant_config

    if not hasattr(module, "to_quantized") or f"{path}.scales" not in tensors:
        return False
    quantization = quantization or {}
    for key in [f"{prefix}{path}" for prefix in prefixes] + [path]:
        if key in quantization:
            entry = quantization[key]
            if not isinstance(entry, dict):
                return bool(entry) and _as_params(quantization)
            return _as_params({**_as_params(quantization), **entry})
    return infer_quant_config(path, module, tensors)


def _as_params(q: dict) -> dict:
    """The group_size, bits and mode of a quantization entry (mlx-lm's defaults where absent)."""
    return {"group_size": q.get("group_size", 64), "bits": q.get("bits", 4), "mode": q.get("mode", "affine")}


def _quantizable(group_size: int):
    def predicate(path: str, module: nn.Module) -> bool:
        if not isinstance(module, nn.Linear) or ".switch_mlp." in f".{path}.":
            return False  # norms, embeddings, MoE experts (SwitchLinear is no nn.Linear anyway)
        if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
            return False  # the router and the shared expert's gate: tiny, and they pick the experts
        return module.weight.shape[-1] % group_size == 0
    return predicate


def quantize_head(head: nn.Module, bits: int, group_size: int = GROUP_SIZE) -> nn.Module:
    """Quantize the head's linear layers in place (see the module docstring); 16 leaves it as is."""
    if bits != 16:
        nn.quantize(head, group_size, bits, class_predicate=_quantizable(group_size))
    return head


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters, from shapes and dtypes alone (lazy arrays stay unevaluated)."""
    total = 0
    for _, p in tree_flatten(module.parameters()):
        n = 1
        for d in p.shape:
            n *= d
        total += n * p.dtype.size
    return total


def stored_bits(head: nn.Module) -> Optional[int]:
    """The bits of a head's quantized layers, or None when none is quantized."""
    bits = {m.bits for _, m in head.named_modules() if isinstance(m, nn.QuantizedLinear)}
    return max(bits) if bits else None


def format_bytes(n: int) -> str:
    """0.45 GB, or 1.0 MB below 0.1 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@dataclass(frozen=True)
class HeadMemory:
    """What the head takes in memory, at what precision, from where."""

    bytes: int
    bits: int  # 16: not quantized
    dtype: str  # the float dtype of its unquantized tensors (norms at least)
    group_size: Optional[int]
    source: str

    @property
    def precision(self) -> str:
        return f"{self.bits}-bit" if self.bits != 16 else self.dtype

    def line(self) -> str:
        """The log line at load: `MTP head: 0.45 GB, 8-bit, from <source>`."""
        return f"MTP head: {format_bytes(self.bytes)}, {self.precision}, from {self.source}"

    def as_json(self) -> dict:
        return {"bytes": self.bytes, "bits": self.bits, "precision": self.precision,
                "group_size": self.group_size, "source": self.source}


def head_memory(head: nn.Module, source: str) -> HeadMemory:
    """The HeadMemory of a built head."""
    bits = stored_bits(head)
    group = {m.group_size for _, m in head.named_modules() if isinstance(m, nn.QuantizedLinear)}
    dtype = str(head.norm.weight.dtype).rsplit(".", 1)[-1]
    return HeadMemory(module_bytes(head), bits or 16, dtype, min(group) if group else None, source)


def _linear_bytes(out: int, inp: int, bits: int, group_size: int, itemsize: int) -> int:
    """A [out, inp] weight at `bits`: packed values plus a scale and a bias per group, in `itemsize`."""
    if bits == 16 or inp % group_size:
        return out * inp * itemsize
    return out * inp * bits // 8 + 2 * out * (inp // group_size) * itemsize


def planned_bytes(text_config: dict, bits: int, itemsize: int = 2, group_size: int = GROUP_SIZE) -> int:
    """Bytes the head of a trunk with `text_config` takes in memory at `bits`, by arithmetic on the
    config's values (mtp-reference.md's tensor table); `itemsize` of its float tensors (bf16: 2)."""
    c = text_config
    h, n, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // n
    lin = lambda out, inp: _linear_bytes(out, inp, bits, group_size, itemsize)  # noqa: E731
    layer = lin(2 * n * d, h) + 2 * lin(kv * d, h) + lin(h, n * d) + (2 * h + 2 * d) * itemsize  # attention, norms
    if c.get("num_experts", 0) > 0:  # experts, router and shared-expert gate stay as stored
        e, moe, shared = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
        layer += 3 * e * moe * h * itemsize + (e + 1) * h * itemsize
        layer += 2 * lin(shared, h) + lin(h, shared)
    else:
        i = c["intermediate_size"]
        layer += 2 * lin(i, h) + lin(h, i)
    layers = int(c.get("mtp_num_hidden_layers") or 1)
    return lin(h, 2 * h) + 3 * h * itemsize + layers * layer  # fc, two pre-fc norms and mtp.norm
