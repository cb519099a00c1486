"""Dyno's engine: exact MTP speculative decoding for Qwen3.5-family models on MLX.

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
]
