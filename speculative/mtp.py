"""The MTP head: module, weight loading (with the +1 norm shift) and the standalone folder format.

Forward (mtp-reference.md): x = fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)]), one
gated full-attention decoder layer with its own KV cache, then mtp.norm; logits come from the
trunk's lm_head. `h` is the trunk's post-final-norm hidden, or the head's own output when
recursing for depth > 1.
"""

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer

from .errors import DynoError
from .tensors import checkpoint_files, read_tensors

HEAD_FORMAT = "dyno-mtp-head"
HEAD_FORMAT_VERSION = 1
HEAD_WEIGHTS = "mtp.safetensors"
# Where heads live: original checkpoints use `mtp.`; some re-exports `language_model.mtp.`.
CHECKPOINT_PREFIXES = ("mtp.", "language_model.mtp.", "model.mtp.")
# The 1-D norms stored zero-centred in raw HF checkpoints (the layer ones repeat per layer).
_NORM_RE = re.compile(
    r"^(pre_fc_norm_embedding|pre_fc_norm_hidden|norm"
    r"|layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.q_norm|self_attn\.k_norm))"
    r"\.weight$"
)


class MTPHead(nn.Module):
    """The multi-token-prediction layer(s) of a Qwen3.5-family checkpoint."""

    def __init__(self, args, num_layers: int = 1):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # layer_idx = interval - 1 makes mlx-lm build its full-attention layer type.
        self.layers = [DecoderLayer(args, args.full_attention_interval - 1) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(h, eps=eps)

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: List[KVCache]) -> mx.array:
        """[B, T, H] token embeddings and hiddens -> post-mtp.norm hidden [B, T, H]."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )  # embedding first, as the checkpoints were trained
        x = self.fc(x)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        return self.norm(x)


def shift_norms(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Raw HF norms multiply by (1 + w): add 1 in fp32, then cast back. Apply exactly once."""
    return {
        k: (v.astype(mx.float32) + 1.0).astype(v.dtype) if _NORM_RE.match(k) else v
        for k, v in weights.items()
    }


@dataclass
class HeadWeights:
    """Head tensors under module-relative names (e.g. `fc.weight`), with where they came from."""

    tensors: Dict[str, mx.array]
    norms_shifted: bool
    source: str
    provenance: dict = field(default_factory=dict)

    def shifted(self) -> Dict[str, mx.array]:
        """Tensors ready for MTPHead: norms shifted exactly once."""
        return self.tensors if self.norms_shifted else shift_norms(self.tensors)


def _strip(name: str) -> Optional[str]:
    for prefix in CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def checkpoint_is_raw_hf(files: Dict[str, Path]) -> bool:
    """Provenance, not values: raw HF checkpoints keep conv1d weights as [C, 1, K] (K > 1)."""
    from .tensors import read_header

    for name, path in files.items():
        if name.endswith("linear_attn.conv1d.weight"):
            return read_header(path)[name]["shape"][-1] != 1
    return False


def read_checkpoint_head(folder: Path) -> Optional[HeadWeights]:
    """The `mtp.*` tensors of a model checkpoint, reading only those tensors; None if absent."""
    files = checkpoint_files(folder)
    names = {n: _strip(n) for n in files}
    names = {n: r for n, r in names.items() if r is not None}
    if not names or any(not files[n].exists() for n in names):
        return None  # no head, or a partial snapshot (index only) that lacks the head's shards
    tensors = {}
    for path in sorted(set(files[n] for n in names)):
        wanted = [n for n in names if files[n] == path]
        for n, arr in read_tensors(path, wanted).items():
            tensors[names[n]] = arr
    raw = checkpoint_is_raw_hf(files)
    # An MLX conversion that kept its head converted it along with the trunk (norms shifted).
    return HeadWeights(tensors, norms_shifted=not raw, source=str(folder),
                       provenance={"kind": "checkpoint", "raw_hf": raw})


def read_head_folder(folder: Path) -> HeadWeights:
    """Load a standalone head folder (config.json + mtp.safetensors)."""
    folder = Path(folder)
    config_path, weights_path = folder / "config.json", folder / HEAD_WEIGHTS
    if not folder.is_dir():
        raise DynoError(f"MTP head folder not found: {folder}")
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise DynoError(f"not an MTP head folder (no config.json): {folder}") from None
    except (OSError, ValueError) as e:
        raise DynoError(f"cannot read {config_path}: {e}") from None
    if config.get("format") != HEAD_FORMAT:
        raise DynoError(f"not an MTP head folder ({config_path} has no \"format\": \"{HEAD_FORMAT}\")")
    if not weights_path.exists():
        raise DynoError(f"MTP head folder {folder} has no {HEAD_WEIGHTS}")
    from .tensors import read_header

    raw = read_tensors(weights_path, read_header(weights_path).keys())
    tensors = {(_strip(k) or k): v for k, v in raw.items()}
    return HeadWeights(tensors, norms_shifted=bool(config["norms_shifted"]), source=str(folder),
                       provenance=config)


def write_head_folder(folder: Path, head: HeadWeights, text_config: dict, extra: dict = None) -> Path:
    """Write a standalone head folder atomically (temp folder, then rename); norms stored shifted."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        mx.save_safetensors(str(tmp / HEAD_WEIGHTS), {f"mtp.{k}": v for k, v in head.shifted().items()})
        config = {
            "format": HEAD_FORMAT,
            "format_version": HEAD_FORMAT_VERSION,
            "norms_shifted": True,
            "architecture": "moe" if is_moe_head(head.tensors) else "dense",
            "text_config": text_config,
            "source": {"from": head.source, **head.provenance.get("source", {})},
            **(extra or {}),
        }
        if config["architecture"] == "moe":  # quantized MoE heads collapse acceptance (5-11% vs 79-85%)
            config["moe_experts_dtype"] = "bfloat16 (never quantized)"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


_EXPERT_RE = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|scales|biases)$")


def sanitize_moe(tensors: Dict[str, mx.array], quantization: Optional[dict] = None) -> Dict[str, mx.array]:
    """MoE head tensors in checkpoint layouts -> mlx-lm's SwitchGLU names, experts in bf16.

    Fused: experts.gate_up_proj [E, 2I, H] (gate is the first half of dim -2, no transpose) and
    experts.down_proj [E, H, I]. One by one: experts.{e}.{gate,up,down}_proj.*, stacked; quantized
    ones are dequantized, since a quantized MoE head is reported to collapse acceptance.
    """
    out, per_expert = {}, {}
    for name, v in tensors.items():
        if m := _EXPERT_RE.match(name):
            per_expert.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = v
        elif name.endswith(".experts.gate_up_proj"):
            prefix, mid = name[: -len(".experts.gate_up_proj")], v.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = v[..., :mid, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = v[..., mid:, :]
        elif name.endswith(".experts.down_proj"):
            out[f"{name[: -len('.experts.down_proj')]}.switch_mlp.down_proj.weight"] = v
        else:
            out[name] = v
    for (prefix, proj, kind), by_e in per_expert.items():
        if kind != "weight":
            continue
        stack = lambda k: mx.stack([per_expert[(prefix, proj, k)][e] for e in sorted(by_e)])
        w = stack("weight")
        if (prefix, proj, "scales") in per_expert:
            q = quantization or {"group_size": 64, "bits": 4}
            biases = stack("biases") if (prefix, proj, "biases") in per_expert else None
            w = mx.dequantize(w, stack("scales"), biases, q["group_size"], q["bits"]).astype(mx.bfloat16)
        out[f"{prefix}.switch_mlp.{proj}_proj.weight"] = w
    return out


def is_moe_head(tensors: Dict[str, mx.array]) -> bool:
    return any(".mlp.gate.weight" in k or ".experts." in k or ".switch_mlp." in k for k in tensors)


def build_head(args, weights: HeadWeights, quantization: Optional[dict] = None) -> MTPHead:
    """Make an MTPHead for a trunk with `args` and load `weights`, checking every shape."""
    tensors = sanitize_moe(weights.shifted(), quantization)
    trunk_moe = getattr(args, "num_experts", 0) > 0
    if is_moe_head(tensors) != trunk_moe:
        kinds = ("a mixture-of-experts", "a dense") if trunk_moe else ("a dense", "a mixture-of-experts")
        raise DynoError(
            f"MTP head in {weights.source} does not fit this model: the model is {kinds[0]} model "
            f"but the head is {kinds[1]} head"
        )
    layer_ids = {int(m.group(1)) for k in tensors if (m := re.match(r"layers\.(\d+)\.", k))}
    head = MTPHead(args, num_layers=max(layer_ids) + 1 if layer_ids else 1)
    if quantization and any(k.endswith(".scales") for k in tensors):  # a quantized dense layer
        nn.quantize(head, quantization["group_size"], quantization["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in tensors)
    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join(f"mtp.{m}" for m in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise DynoError(f"MTP head in {weights.source} is missing tensors: {shown}")
    # fc.weight first: its [H, 2H] shape names the hidden size, the usual culprit.
    for name, want in sorted(expected.items(), key=lambda kv: kv[0] != "fc.weight"):
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise DynoError(
                f"MTP head in {weights.source} does not fit this model: mtp.{name} has shape "
                f"{list(got.shape)}, the model needs {list(want.shape)}"
            )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise DynoError(f"MTP head in {weights.source} has unexpected tensors: mtp.{unexpected[0]}")
    head.load_weights(list(tensors.items()), strict=True)
    head.eval()
    mx.eval(head.parameters())
    return head
