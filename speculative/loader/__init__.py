"""Loading a Qwen3.5-family checkpoint through mlx-lm, and its MTP head when there is one; `source`
says where its files are (a folder, or a Hugging Face repo id)."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn

from ..backend import widen_experts
from ..errors import DynoError, one_line
from ..heads.health import HeadHealth
from ..heads.find import resolve_head
from ..heads.mtp import NORM_RE, MTPHead, build_head, read_checkpoint_head
from ..heads import norm_decision
from ..heads import precision
from ..heads.precision import HeadMemory
from .source import ModelSource, resolve
from ..backend.memory import model_bytes, recommended_size, size_warning
from ..target import Target
from .vision import Vision, load_vision

DENSE_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# mlx-lm has modules only for the wrapper types; its ModelArgs wraps a bare text config itself.
_MLX_LM_TYPE = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


@dataclass
class LoadedModel:
    """A model ready to generate: mlx-lm model + tokenizer, trunk adapter, optional head."""

    path: Path
    model: nn.Module
    tokenizer: object
    config: dict
    target: Optional[Target]
    head: Optional[MTPHead]
    head_source: Optional[str]
    notices: List[str] = field(default_factory=list)
    generation_config: dict = field(default_factory=dict)
    head_memory: Optional[HeadMemory] = None  # bytes, precision and source of the head in memory
    ranks: Optional[Any] = None  # distributed.Ranks when the model is split across processes, else None
    repo_id: Optional[str] = None  # the Hugging Face repo it was named by (or whose cache snapshot it is)
    head_health: Optional[HeadHealth] = None  # whether the head's drafts work (heads/health.py); with a head
    notify: Optional[Callable[[str], None]] = None  # where notices after loading go too (the loader's `notify`)
    norm_decision: Optional[str] = None  # how the head's +1 norm shift was decided at load, when it was
    vision: Optional[Vision] = None  # the vision tower and image processor, when the checkpoint has them
    vision_error: Optional[str] = None  # why this model takes no images (no tower, no mlx-vlm), when it does not

    @property
    def name(self) -> str:
        """What the model is called in /v1/models and notices: the repo id typed, else the folder's name."""
        return self.repo_id or self.path.name

    def note(self, message: str) -> None:
        """A notice: kept in `notices` and passed to `notify`."""
        self.notices.append(message)
        if self.notify:
            self.notify(message)

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)

    @property
    def vocab_size(self) -> int:
        """Rows of the logits (the config's vocab_size, else the tokenizer's length)."""
        return int(self.text_config.get("vocab_size") or len(self.tokenizer))

    @property
    def context_length(self) -> int:
        """The longest sequence the model takes (max_position_embeddings)."""
        return int(self.text_config.get("max_position_embeddings")
                   or self.config.get("max_position_embeddings") or 2**31)

    @property
    def eos_token_ids(self) -> set:
        ids = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        gen = self.generation_config.get("eos_token_id")
        ids.update(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        return ids


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise DynoError(f"cannot read {what} {path}: {e.strerror}") from None
    except ValueError as e:
        raise DynoError(f"{what} {path} is not valid JSON: {e}") from None


def load_checkpoint(path, mode: str = "auto", mtp_head: Optional[str] = None, mtp_base: Optional[str] = None,
                    notify: Optional[Callable[[str], None]] = None, head_bits=None,
                    shard: Optional[Callable[[nn.Module], None]] = None, repo_id: Optional[str] = None) -> LoadedModel:
    """Load `path` with mlx-lm; attach its MTP head unless mode is "off".

    `path` is a folder or a Hugging Face repo id (source.resolve: the local cache, else a
    download); `repo_id` says which repo a folder already resolved is the snapshot of.

    The plain loader; `speculative.load_model` is the public recipe (this, then the draft
    vocabulary and depth, as a SpecConfig).

    `notify` receives notices while loading (e.g. before a head download, and the head's
    `MTP head: ...` memory line); they are also kept in `notices`. `head_bits` (16, 8, 4, or
    None/"auto": follow the trunk, see heads/precision.py) is the precision the head is kept at.
    `shard` (distributed.py) splits the lazily loaded model before its weights are read.
    """
    precision.parse_head_bits(head_bits)  # a bad value fails before anything loads
    spec = path
    if repo_id is None:
        source = resolve(spec, notify, check_config=lambda config: _check_family(spec, config, mode))
    else:
        source = ModelSource(Path(path).expanduser(), repo_id)
    path = source.folder
    if not path.exists():
        raise DynoError(f"model path not found: {path}")
    if not path.is_dir() or not (path / "config.json").exists():
        raise DynoError(f"not a model folder (no config.json): {path}")
    config = _read_json(path / "config.json", "model config")
    family = _check_family(source.repo_id or path, config, mode)
    model_type = config.get("model_type", "")
    from mlx_lm.utils import load as mlx_lm_load

    overrides = {"model_type": _MLX_LM_TYPE[model_type]} if model_type in _MLX_LM_TYPE else {}
    try:
        model, tokenizer = mlx_lm_load(str(path), model_config=overrides, lazy=shard is not None)
        if shard is not None:  # mlx-lm's own sharding, as its sharded_load: each rank reads its part only
            shard(model)
            mx.eval(model.parameters())
    except DynoError:
        raise
    except Exception as e:  # mlx-lm raises many types; the user needs one line
        raise DynoError(f"cannot load model {path}: {one_line(e)}") from None
    gen_path = path / "generation_config.json"
    generation_config = _read_json(gen_path, "generation config") if gen_path.exists() else {}
    lm = LoadedModel(path, model, tokenizer, config, None, None, None, [], generation_config, repo_id=source.repo_id,
                     notify=notify)
    note = lm.note

    widened = widen_experts(model)
    if widened:
        note(f"dyno: MLX on this device has no {'/'.join(sorted(widened))} kernel for MoE experts; "
             "running them in float32")
    if family:
        lm.target = Target(model)
        if shard is None:
            lm.vision, lm.vision_error = load_vision(path, config)
        else:
            lm.vision_error = "images are not supported on a model split across processes"
    if mode != "off" and family:
        _attach_head(lm, mode, mtp_head, mtp_base, note, head_bits)
    if mode == "auto" and lm.head is None and not any("without drafts" in n for n in lm.notices):
        reason = "it is not a Qwen3.5-family model" if not family else "it has no MTP head"
        note(f"dyno: decoding without drafts: {lm.name}: {reason}")
    # Once per model, not once per generation as mlx-lm's wired_limit prints it (memory.py).
    if warning := size_warning(model_bytes(lm.model, lm.head), recommended_size()):
        note(warning)
    return lm


def _check_family(where, config: dict, mode: str) -> bool:
    """Whether `config` is a Qwen3.5-family model; under "mtp" one that is not is an error."""
    model_type = config.get("model_type", "")
    family = model_type in DENSE_TYPES + MOE_TYPES
    if mode == "mtp" and not family:
        raise DynoError(
            f"{where} is a {model_type or 'unknown'} model; MTP drafting needs a Qwen3.5/3.6/3.8 "
            f"model (model_type qwen3_5 or qwen3_5_moe)"
        )
    return family


def _attach_head(lm: LoadedModel, mode: str, mtp_head: Optional[str], mtp_base: Optional[str], note,
                 bits=None) -> None:
    """Find the head (see heads.find.resolve_head), check it fits, build it; a head that cannot be
    used is a notice in "auto" and one DynoError line in "mtp", never a traceback."""
    try:
        _find_and_build_head(lm, mtp_head, mtp_base, note, bits)
        return
    except DynoError as e:
        error = e
    # Last resort: head files come from anywhere; a slip in reading one must cost drafting, not the model.
    except Exception as e:
        error = DynoError(f"cannot load the MTP head: {_cause(e)}")
    if mode == "mtp":
        raise error from None
    note(f"dyno: decoding without drafts: {error.message}")


def _find_and_build_head(lm: LoadedModel, mtp_head: Optional[str], mtp_base: Optional[str],
                         note, bits=None) -> None:
    """Resolve the head, check it fits the trunk and set lm.head; raises DynoError when it cannot
    (resolve_head's, which says what was tried, when there is no head at all).

    The model's own head comes first; one that cannot be built gives a notice, and the head is
    looked for as for a model without one (Dyno cache, Hugging Face cache, the original's head).
    """
    own_error = None
    if not mtp_head:
        try:
            own = read_checkpoint_head(lm.path)
            if own is not None:
                _build(lm, own, note, bits)
                return
        except DynoError as e:
            own_error = e
    try:
        weights = resolve_head(lm.path, lm.config, note, mtp_head, mtp_base, repo_id=lm.repo_id, own=False)
    except DynoError:
        if own_error is None:
            raise
        raise own_error from None  # nothing to fall back on: the own head's fault is the one to report
    if own_error is not None:
        note(f"dyno: the MTP head in {lm.path} cannot be used: {own_error.message}; "
             f"drafting with the head from {weights.source}")
    _build(lm, weights, note, bits)


def _build(lm: LoadedModel, weights, note, bits=None) -> None:
    """Build `weights` into lm.head, deciding its norm convention first when provenance did not."""
    _check_fit(lm, weights)
    trunk_quantization = lm.config.get("quantization")
    quantization = weights.quantization or trunk_quantization
    chosen = precision.head_bits(bits, trunk_quantization)
    if weights.norms_shifted is None:
        # Built as stored, then its norms are read each possible way (heads/norm_decision.py).
        head = build_head(lm.target.args, weights.decided((), {}), quantization, chosen)
        groups, decision = norm_decision.decide_norms(lm.target, lm.tokenizer, head, weights)
        weights = weights.decided(groups, decision)
        head.load_weights([(k, v) for k, v in weights.tensors.items() if NORM_RE.match(k)], strict=False)
        mx.eval(head.parameters())
        note(norm_decision.notice(weights.source, decision))
        lm.norm_decision = f"{norm_decision.describe(decision['shifted_at_load'])}, decided at load"
        lm.head = head
    else:
        lm.head = build_head(lm.target.args, weights, quantization, chosen)
    widen_experts(lm.head)  # before measuring it: float32 experts where bf16 has no kernel
    lm.head_source = weights.source
    lm.head_memory = precision.head_memory(lm.head, weights.source)
    lm.head_health = HeadHealth()
    requested = precision.parse_head_bits(bits)
    if requested is not None and requested != lm.head_memory.bits:  # stored quantized: no bits to add back
        note(f"dyno: the MTP head in {weights.source} is stored {lm.head_memory.precision}; "
             f"kept so, not at the {requested} bits asked for")
    note(lm.head_memory.line())


def _cause(e: Exception) -> str:
    """`KeyError: 'x'`: the exception's type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _check_fit(lm: LoadedModel, weights) -> None:
    """A standalone head (or a checkpoint it is grafted from) records the hidden size and vocabulary it
    was trained with; they must be the trunk's."""
    text = weights.provenance.get("text_config")
    text = text if isinstance(text, dict) else {}
    args = lm.target.args
    # The hidden size first: a head of another size also fails on fc's shape, less plainly.
    for key, what in (("hidden_size", "a hidden size"), ("vocab_size", "a vocabulary")):
        want = getattr(args, key)
        if key in text and text[key] != want:
            raise DynoError(f"MTP head in {weights.source} does not fit this model: it was made for "
                            f"{what} of {text[key]}, the model has {want}")
