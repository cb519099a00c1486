"""Dyno's engine: exact MTP speculative decoding for Qwen3.5-family models on MLX.

    lm, spec = load_model("path/to/model")    # trunk + MTP head, draft vocabulary and depth settled
    # (a folder, or a Hugging Face repo id such as "mlx-community/Qwen3.6-27B-4bit": cached, else downloaded)
    for event in generate(lm, prompt_ids, SamplingParams(), spec):
        ...                                   # Token (with provenance), Round (Parked), then Done

This package never imports HTTP or UI code; `dyno_ui` builds on it.
"""

from .config import SamplingParams, SpecConfig
from .errors import DynoError
from .events import Done, Parked, Provenance, Round, Token

__all__ = [
    "Done",
    "DynoError",
    "Parked",
    "Provenance",
    "Round",
    "SamplingParams",
    "SpecConfig",
    "Token",
    "generate",
    "load_model",
]


def load_model(path, mode: str = "auto", draft_depth="auto", draft_vocab="auto", notify=None, split=None,
               batched: bool = False, copies: str = "off", **load_kw):
    """(LoadedModel, SpecConfig): `path` loaded and how it drafts settled, once.

    The model and its head (loader.load_checkpoint; `load_kw`: mtp_head, mtp_base, head_bits), then the draft
    vocabulary (N, "auto" or None: draft_vocab.head.resolve), then the depth (N or "auto", depth.decide):
    the SpecConfig's `draft_depth` for a request decoded alone and its `policy` for batched rounds
    (`batched`: measured for them when "auto"; else pinned at that depth). `notify` receives the notices.
    `split` (a distributed.Member) loads this rank's part instead: its depth is the one given, else the
    one `dyno tune` stored, else the default, never a cost-model estimate, and each rank's engine
    resolves the draft vocabulary alike.
    """
    # Imported here: they pull in MLX and mlx-lm, which settings and errors alone do not need.
    from .attention_kernels import depth_notice
    from .config import DEFAULT_DRAFT_DEPTH
    from .depth import decide
    from .draft_vocab.head import resolve
    from .loader import load_checkpoint as load

    if split is not None:
        lm = split.load(path, mode=mode, notify=notify, **load_kw)
        vocab = draft_vocab
    else:
        lm = load(path, mode=mode, notify=notify, **load_kw)
        vocab = resolve(lm, draft_vocab, notify)
    depth, policy = decide(lm, draft_depth, vocab, DEFAULT_DRAFT_DEPTH, batched=batched and split is None and mode != "off",
                           split=split is not None, notify=notify or (lambda message: None))
    notice = depth_notice(lm.text_config, depth) if lm.head is not None and mode != "off" else None
    if notice is not None and notify is not None:
        notify(f"warning: {notice}")
    return lm, SpecConfig(mode, depth, vocab, policy=policy, copies=copies)


def __getattr__(name):
    # Imported on first use, as above.
    if name == "generate":
        from .engine import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
