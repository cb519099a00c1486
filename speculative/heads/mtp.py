"""The MTP head: module, weight loading (with the +1 norm shift) and the standalone folder format.

Forward (mtp-reference.md): x = fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)]), one
gated full-attention decoder layer with its own KV cache, then mtp.norm; logits come from the
trunk's lm_head. `h` is the trunk's post-final-norm hidden, or the head's own output when
recursing for depth > 1.
"""

import json
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer

from ..errors import DynoError
from .precision import quantize_head, stored_quantization
from .tensors import INDEX, checkpoint_files, dequantize_fp8, read_header, read_tensors

HEAD_FORMAT = "dyno-mtp-head"
HEAD_FORMAT_VERSION = 1
HEAD_WEIGHTS = "mtp.safetensors"
# Where heads live: original checkpoints use `mtp.`; re-exports `language_model.mtp.`,
# `model.mtp.` or `model.language_model.mtp.`. Longest first, so the most specific one strips.
CHECKPOINT_PREFIXES = ("model.language_model.mtp.", "language_model.mtp.", "model.mtp.", "mtp.")
# The 1-D norms stored zero-centred in raw HF checkpoints (the layer ones repeat per layer), in the
# three groups a converter may or may not have shifted: the head's own, the layers', the q/k ones.
NORM_GROUPS = {
    "top": re.compile(r"^(pre_fc_norm_embedding|pre_fc_norm_hidden|norm)\.weight$"),
    "layer": re.compile(r"^layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight$"),
    "qk": re.compile(r"^layers\.\d+\.self_attn\.(q_norm|k_norm)\.weight$"),
}
ALL_NORMS = tuple(NORM_GROUPS)
NORM_RE = re.compile("|".join(f"(?:{r.pattern})" for r in NORM_GROUPS.values()))


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

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: List[KVCache], rope=None) -> mx.array:
        """[B, T, H] token embeddings and hiddens -> post-mtp.norm hidden [B, T, H].

        `rope` (target.MRoPE, a prompt with images) puts its rows at the trunk's M-RoPE positions.
        """
        x = self._fused(embeddings, hidden)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c) if rope is None else rope.layer(layer, x, mask, c)
        return self.norm(x)

    def _fused(self, embeddings: mx.array, hidden: mx.array) -> mx.array:
        """The first layer's input: fc over the normed embeddings and hiddens."""
        return self.fc(mx.concatenate(  # embedding first, as the checkpoints were trained
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1))

    def remember(self, embeddings: mx.array, hidden: mx.array, cache: List[KVCache], rope=None) -> None:
        """Head rows whose outputs nothing reads (a prompt's, those plain rounds owe): into `cache`
        as __call__ puts them, without the last layer's queries, attention and MLP or the final norm,
        since later rows attend only to their keys and values (on this CPU a prompt's head pass costs
        about a fifth of __call__'s)."""
        if rope is not None:  # M-RoPE turns queries and keys together (target.MRoPE): the whole pass
            self(embeddings, hidden, cache, rope)
            return
        x = self._fused(embeddings, hidden)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers[:-1], cache):
            x = layer(x, mask, c)
        # The last layer's keys and values, op for op as mlx-lm's Qwen3NextAttention makes them.
        attn, c = self.layers[-1].self_attn, cache[len(self.layers) - 1]
        y = self.layers[-1].input_layernorm(x)
        B, L, _ = y.shape
        keys = attn.k_norm(attn.k_proj(y).reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        values = attn.v_proj(y).reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        c.update_and_fetch(attn.rope(keys, offset=c.offset), values)


def shift_norms(weights: Dict[str, mx.array], groups=ALL_NORMS) -> Dict[str, mx.array]:
    """Raw HF norms multiply by (1 + w): add 1 in fp32, then cast back, for the norms in `groups`
    (NORM_GROUPS). Apply exactly once."""
    pattern = [NORM_GROUPS[g] for g in groups]
    return {
        k: (v.astype(mx.float32) + 1.0).astype(v.dtype) if any(r.match(k) for r in pattern) else v
        for k, v in weights.items()
    }


@dataclass
class HeadWeights:
    """Head tensors under module-relative names (e.g. `fc.weight`), with where they came from."""

    tensors: Dict[str, mx.array]
    norms_shifted: Optional[bool]  # None: unknown (an MLX conversion, a drafter repo), decided at load
    source: str
    provenance: dict = field(default_factory=dict)
    quantization: Optional[dict] = None  # the config.json `quantization` its tensors were packed with

    def shifted(self) -> Dict[str, mx.array]:
        """Tensors ready for MTPHead: norms shifted exactly once."""
        if self.norms_shifted is None:
            raise DynoError(f"the norm convention of the MTP head in {self.source} is not decided yet")
        return self.tensors if self.norms_shifted else shift_norms(self.tensors)

    def decided(self, groups, decision: dict) -> "HeadWeights":
        """The same head with the norm `groups` found raw shifted now, and how that was decided."""
        return HeadWeights(shift_norms(self.tensors, groups), True, self.source,
                           {**self.provenance, "norm_decision": decision}, self.quantization)


def _strip(name: str) -> Optional[str]:
    for prefix in CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def norm_probe(files: Dict[str, object]) -> Optional[Tuple[str, object]]:
    """(name, file) of the tensor whose layout tells raw HF from MLX: the first conv1d weight."""
    return next(((n, f) for n, f in files.items() if n.endswith("linear_attn.conv1d.weight")), None)


def checkpoint_is_raw_hf(files: Dict[str, Path]) -> bool:
    """Provenance, not values: raw HF checkpoints keep conv1d weights as [C, 1, K] (K > 1)."""
    probe = norm_probe(files)
    if probe is None:
        return False
    name, path = probe
    entry = read_header(path).get(name)
    if entry is None:
        raise DynoError(f"safetensors file {path} has no tensor {name}, which {INDEX} places there")
    if len(entry["shape"]) != 3:  # [C, 1, K] raw, [C, K, 1] MLX: anything else is no conv1d weight
        raise DynoError(f"{name} in {path} has shape {entry['shape']}, not a conv1d weight [C, 1, K]")
    return entry["shape"][-1] != 1


def read_checkpoint_head(folder: Path) -> Optional[HeadWeights]:
    """The `mtp.*` tensors of a model checkpoint, reading only those tensors; None if absent.

    FP8 weights with block scales come back in bf16. A raw HF checkpoint's norms are known to be
    zero-centred; an MLX conversion's are unknown (converters shift all, some or none of them), so
    its norms_shifted is None and the loader decides (heads/norm_decision.py).
    """
    files = checkpoint_files(folder)
    names = {n: _strip(n) for n in files}
    names = {n: r for n, r in names.items() if r is not None}
    if not names or any(not files[n].exists() for n in names):
        return None  # no head, or a partial snapshot (index only) that lacks the head's shards
    tensors = {}
    for path in sorted(set(files[n] for n in names)):
        wanted = [n for n in names if files[n] == path]
        header = read_header(path)
        absent = [n for n in wanted if n not in header]
        if absent:
            more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
            raise DynoError(f"safetensors file {path} has no tensor {absent[0]}{more}, which {INDEX} places there")
        for n, arr in read_tensors(path, wanted, header).items():
            tensors[names[n]] = arr
    raw = checkpoint_is_raw_hf(files)
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    quantization = config.get("quantization") if isinstance(config, dict) else None
    return HeadWeights(dequantize_fp8(tensors), norms_shifted=False if raw else None, source=str(folder),
                       provenance={"kind": "checkpoint", "raw_hf": raw},
                       quantization=quantization if isinstance(quantization, dict) else None)


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
    except OSError as e:
        raise DynoError(f"cannot read {config_path}: {e.strerror or e}") from None
    except ValueError as e:
        raise DynoError(f"{config_path} is not valid JSON: {e}") from None
    if isinstance(config, dict) and "format" not in config and any(folder.glob("*.safetensors")):
        embedded = read_embedded_head(folder, config)
        return embedded if embedded is not None else read_drafter_folder(folder, config)
    if not isinstance(config, dict) or config.get("format") != HEAD_FORMAT:
        raise DynoError(f"not an MTP head folder ({config_path} has no \"format\": \"{HEAD_FORMAT}\")")
    problem = _head_config_problem(config)
    if problem:
        raise DynoError(f"MTP head config {config_path} {problem}")
    if not weights_path.exists():
        raise DynoError(f"MTP head folder {folder} has no {HEAD_WEIGHTS}")
    header = read_header(weights_path)
    raw = read_tensors(weights_path, list(header), header)
    tensors = {(_strip(k) or k): v for k, v in raw.items()}
    quantization = config.get("quantization")
    return HeadWeights(tensors, norms_shifted=config["norms_shifted"], source=str(folder), provenance=config,
                       quantization=quantization if isinstance(quantization, dict) else None)


def read_embedded_head(folder: Path, config: dict) -> Optional[HeadWeights]:
    """The head of a full checkpoint (trunk and `mtp.*` tensors, as the bundled model ships), for
    grafting onto another model; None when `folder` is no such checkpoint (a drafter repo, whose
    tensors are all the head's). Only the head's tensors are read; `text_config` records the shape
    and vocabulary it was made for, which the loader holds against the model's."""
    names = list(checkpoint_files(folder))
    if not any(_strip(n) for n in names) or all(_strip(n) for n in names):
        return None
    head = read_checkpoint_head(folder)
    if head is None:  # an index naming head shards this snapshot lacks
        raise DynoError(f"the checkpoint in {folder} lists mtp.* tensors but lacks the files that hold them")
    text = config.get("text_config", config)
    head.provenance["text_config"] = text if isinstance(text, dict) else {}
    return head


def read_drafter_folder(folder: Path, config: dict) -> HeadWeights:
    """A drafter repo as mlx-vlm publishes them: config.json and safetensors holding the head's
    tensors under bare names (`fc.weight`, `layers.0...`) or a checkpoint prefix. Nothing says
    whether its norms were shifted: the loader decides (heads/norm_decision.py)."""
    files = checkpoint_files(folder)
    if "fc.weight" not in {_strip(n) or n for n in files}:
        raise DynoError(f"not an MTP head folder or drafter repo (no fc.weight in its safetensors): {folder}")
    tensors = {}
    for path in sorted(set(files.values())):
        wanted = [n for n in files if files[n] == path]
        for n, arr in read_tensors(path, wanted).items():
            tensors[_strip(n) or n] = arr
    quantization = config.get("quantization")
    text = config.get("text_config", config)
    return HeadWeights(dequantize_fp8(tensors), norms_shifted=None, source=str(folder),
                       provenance={"kind": "drafter", "text_config": text if isinstance(text, dict) else {}},
                       quantization=quantization if isinstance(quantization, dict) else None)


def _head_config_problem(config: dict) -> Optional[str]:
    """What is wrong with a head folder's config.json (format already checked), or None."""
    version = config.get("format_version", HEAD_FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        return f"has format_version {version!r}, not a whole number"
    if version > HEAD_FORMAT_VERSION:
        return f"has format_version {version}; this Dyno reads up to {HEAD_FORMAT_VERSION} (upgrade Dyno)"
    # The shift must be stated; null says unknown, decided against the model at load, never from values.
    shifted = config.get("norms_shifted", "absent")
    if not (shifted is None or isinstance(shifted, bool)):
        got = f", got {config['norms_shifted']!r}" if "norms_shifted" in config else ""
        return f"lacks \"norms_shifted\": true or false (whether its norm weights include the +1){got}"
    if config.get("quantization") is not None and not isinstance(config["quantization"], dict):
        return "has a quantization that is not a JSON object"
    if not isinstance(config.get("text_config", {}), dict):
        return "has a text_config that is not a JSON object"
    return None


def swap_in(new: Path, folder: Path) -> None:
    """Put the folder `new` at `folder`. One that is there already is renamed aside first and removed only
    once `new` is in place: a failure in between renames it back, and a kill in between leaves it whole
    as `.<name>.old-<pid>-<random>` beside it, never lost."""
    if not os.path.lexists(folder):
        os.replace(new, folder)
        return
    old = folder.parent / f".{folder.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.replace(folder, old)
    try:
        os.replace(new, folder)
    except BaseException:
        os.replace(old, folder)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


def write_head_folder(folder: Path, head: HeadWeights, text_config: dict, extra: dict = None,
                      files: Optional[Dict[str, str]] = None) -> Path:
    """Write a standalone head folder atomically (temp folder, then rename); norms stored shifted,
    or as read with `norms_shifted: null` when their convention is still to be decided."""
    folder = Path(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as e:
        raise DynoError(f"cannot write the MTP head to {folder}: {e.strerror or e}") from None
    try:
        undecided = head.norms_shifted is None
        tensors = head.tensors if undecided else head.shifted()
        mx.save_safetensors(str(tmp / HEAD_WEIGHTS), {f"mtp.{k}": v for k, v in tensors.items()})
        config = {
            "format": HEAD_FORMAT,
            "format_version": HEAD_FORMAT_VERSION,
            "norms_shifted": None if undecided else True,
            "architecture": "moe" if is_moe_head(head.tensors) else "dense",
            "text_config": text_config,
            "source": {"from": head.source, **head.provenance.get("source", {})},
            **({"quantization": head.quantization} if head.quantization else {}),
            **(extra or {}),
        }
        if config["architecture"] == "moe":  # quantized MoE heads collapse acceptance (5-11% vs 79-85%)
            config["moe_experts_dtype"] = "bfloat16 (never quantized)"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, text in (files or {}).items():  # a card (README.md) goes in with the head, atomically
            (tmp / name).write_text(text)
        swap_in(tmp, folder)
    except (OSError, RuntimeError) as e:  # RuntimeError: mx.save_safetensors failing to write
        shutil.rmtree(tmp, ignore_errors=True)
        raise DynoError(f"cannot write the MTP head to {folder}: {getattr(e, 'strerror', None) or e}") from None
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
    Raises ValueError on a layout that cannot be stacked or split.
    """
    out, per_expert = {}, {}
    for name, v in tensors.items():
        if m := _EXPERT_RE.match(name):
            per_expert.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = v
        elif name.endswith(".experts.gate_up_proj"):
            if v.ndim != 3:
                raise ValueError(f"mtp.{name} has shape {list(v.shape)}, not [experts, 2 x intermediate, hidden]")
            prefix, mid = name[: -len(".experts.gate_up_proj")], v.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = v[..., :mid, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = v[..., mid:, :]
        elif name.endswith(".experts.down_proj"):
            out[f"{name[: -len('.experts.down_proj')]}.switch_mlp.down_proj.weight"] = v
        else:
            out[name] = v
    experts = {}  # prefix -> every expert index named under it: each projection needs them all
    for (prefix, _, _), by_e in per_expert.items():
        experts.setdefault(prefix, set()).update(by_e)
    for (prefix, proj, kind), by_e in per_expert.items():
        if kind != "weight":
            continue
        stack = lambda k: _stack_experts(per_expert[(prefix, proj, k)], sorted(experts[prefix]),
                                         f"{prefix}.experts.*.{proj}_proj.{k}")
        w = stack("weight")
        if (prefix, proj, "scales") in per_expert:
            q = quantization or {}
            q = q.get(f"mtp.{prefix}.experts.0.{proj}_proj", q)  # a per-module entry, else the global one
            q = q if isinstance(q, dict) else quantization or {}
            biases = stack("biases") if (prefix, proj, "biases") in per_expert else None
            w = mx.dequantize(w, stack("scales"), biases, q.get("group_size", 64), q.get("bits", 4),
                              mode=q.get("mode", "affine")).astype(mx.bfloat16)
        out[f"{prefix}.switch_mlp.{proj}_proj.weight"] = w
    return out


def _stack_experts(by_expert: Dict[int, mx.array], experts: List[int], what: str) -> mx.array:
    """One tensor per expert -> [E, ...]; every expert must be there, with the same shape."""
    absent = [e for e in experts if e not in by_expert]
    if absent:
        raise ValueError(f"mtp.{what.replace('*', str(absent[0]))} is missing")
    if len({tuple(by_expert[e].shape) for e in experts}) > 1:
        raise ValueError(f"mtp.{what} differ in shape across experts")
    return mx.stack([by_expert[e] for e in experts])


def is_moe_head(tensors: Dict[str, mx.array]) -> bool:
    return any(".mlp.gate.weight" in k or ".experts." in k or ".switch_mlp." in k for k in tensors)


def build_head(args, weights: HeadWeights, quantization: Optional[dict] = None, bits: int = 16) -> MTPHead:
    """Make an MTPHead for a trunk with `args` and load `weights`, checking every shape and dtype;
    then keep it at `bits` (precision.quantize_head; a head stored quantized stays as stored)."""
    try:
        tensors = sanitize_moe(weights.shifted(), quantization)
    except ValueError as e:  # unstackable or unsplittable experts (mx.stack / mx.dequantize raise it too)
        raise DynoError(f"MTP head in {weights.source} has malformed experts: {e}") from None
    trunk_moe = getattr(args, "num_experts", 0) > 0
    if is_moe_head(tensors) != trunk_moe:
        kinds = ("a mixture-of-experts", "a dense") if trunk_moe else ("a dense", "a mixture-of-experts")
        raise DynoError(
            f"MTP head in {weights.source} does not fit this model: the model is {kinds[0]} model "
            f"but the head is {kinds[1]} head"
        )
    layer_ids = {int(m.group(1)) for k in tensors if (m := re.match(r"layers\.(\d+)\.", k))}
    if layer_ids != set(range(len(layer_ids))):  # also stops a stray layers.99999 from building 10^5 layers
        raise DynoError(f"MTP head in {weights.source} has layers {sorted(layer_ids)}, not numbered from 0")
    head = MTPHead(args, num_layers=max(layer_ids) + 1 if layer_ids else 1)
    if any(k.endswith(".scales") for k in tensors):  # quantized dense layers, each in its own mode
        try:
            nn.quantize(head, class_predicate=lambda p, m: stored_quantization(
                quantization, p, m, tensors, CHECKPOINT_PREFIXES))
        except ValueError as e:  # packing that fits no MLX mode
            raise DynoError(f"MTP head in {weights.source} is quantized in a way MLX cannot read: {e}") from None
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
    _check_values(tensors, expected, weights.source)
    head.load_weights(list(tensors.items()), strict=True)
    if not any(k.endswith(".scales") for k in tensors):
        quantize_head(head, bits)  # at load, from the float tensors: the cache keeps those
    head.eval()
    mx.eval(head.parameters())
    return head


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # mlx.core.bfloat16 -> bfloat16


def _check_values(tensors: Dict[str, mx.array], expected: Dict[str, mx.array], source: str) -> None:
    """Float where the module wants float (any width), packed ints where it is quantized, and
    finite: a NaN draft distribution would break the lossless acceptance rule, not just acceptance."""
    for name, want in sorted(expected.items()):
        got, want_float = tensors[name].dtype, mx.issubdtype(want.dtype, mx.floating)
        if got != want.dtype and not (want_float and mx.issubdtype(got, mx.floating)):
            need = "a floating-point" if want_float else f"a {_dtype_name(want.dtype)}"
            raise DynoError(f"MTP head in {source} has mtp.{name} in {_dtype_name(got)}; the model needs "
                            f"{need} tensor")
    floats = [n for n in sorted(expected) if mx.issubdtype(tensors[n].dtype, mx.floating)]
    finite = mx.stack([mx.all(mx.isfinite(tensors[n])) for n in floats]).tolist() if floats else []
    bad = [n for n, ok in zip(floats, finite) if not ok]
    if bad:
        raise DynoError(f"MTP head in {source} has non-finite values (NaN or inf) in mtp.{bad[0]}: "
                        f"a corrupt file")
