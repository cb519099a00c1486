"""Dyno's engine: exact MTP speculative decoding for Qwen3.5-family models on MLX.

    lm, spec = load_model("path/to/model")    # trunk + MTP head, draft vocabulary and depth settled
    # (a folder, or a Hugging Face repo id such as "mlx-community/Qwen3.6-27B-4bit": cached, else downloaded)
    for event in generate(lm, prompt_ids, SamplingParams(), spec):
        ...                                   # Token (with provenance), Round, then Done

This package never imports HTTP or UI code; `dyno_ui` builds on it.
"""

from .config import SamplingParams, SpecConfig
from .errors import DynoError
from .events import Done, Provenance, Round, Token

__all__ = [
    "Done",
    "DynoError",
    "Provenance",
    "Round",
    "SamplingParams",
    "SpecConfig",
    "Token",
    "generate",
    "load_model",
]


def load_model(path, mode: str = "auto", draft_depth="auto", draft_vocab="auto", notify=None, split=None,
               copies: str = "off", **load_kw):
    """(LoadedModel, SpecConfig): `path` loaded and how it drafts settled, once.

    The model and its head (loader.load_checkpoint; `load_kw`: mtp_head, mtp_base, head_bits), then the draft
    vocabulary (N, "auto" or None: draft_vocab.head.resolve), then the depth (N or "auto":
    measure.tuning.resolve_depth), as a SpecConfig for `generate`. `notify` receives the notices.
    `split` (a distributed.Member) loads this rank's part instead: its depth is the one given, else the
    one `dyno tune` stored, else the default, never a cost-model estimate (its timing runs would be
    collectives on one rank alone), and each rank's engine resolves the draft vocabulary alike.
    """
    # Imported here: they pull in MLX and mlx-lm, which settings and errors alone do not need.
    from .attention_kernels import depth_notice
    from .config import DEFAULT_DRAFT_DEPTH
    from .draft_vocab.head import resolve
    from .loader import load_checkpoint as load
    from .measure.tuning import resolve_depth, stored

    if split is not None:
        lm = split.load(path, mode=mode, notify=notify, **load_kw)
        depth = draft_depth if draft_depth != "auto" else (stored(lm) or {}).get("depth", DEFAULT_DRAFT_DEPTH)
        vocab = draft_vocab
    else:
        lm = load(path, mode=mode, notify=notify, **load_kw)
        vocab = resolve(lm, draft_vocab, notify)
        depth = resolve_depth(lm, draft_depth, vocab) if lm.head is not None else DEFAULT_DRAFT_DEPTH
    notice = depth_notice(lm.text_config, int(depth)) if lm.head is not None and mode != "off" else None
    if notice is not None and notify is not None:
        notify(f"warning: {notice}")
    return lm, SpecConfig(mode, int(depth), vocab, copies=copies)


def __getattr__(name):
    # Imported on first use, as above.
    if name == "generate":
        from .engine import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
