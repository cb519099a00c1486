"""Dyno's engine: exact MTP speculative decoding for Qwen3.5-family models on MLX.

    lm = load_model("path/to/model")          # trunk + MTP head (found, extracted or fetched)
    for event in generate(lm, prompt_ids, SamplingParams(), SpecConfig()):
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


def __getattr__(name):
    # Imported on first use: they pull in MLX and mlx-lm, which settings and errors alone do not need.
    if name == "generate":
        from .engine import generate

        return generate
    if name == "load_model":
        from .loader import load_model

        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
