"""Metal's Gated DeltaNet dispatch on a machine without Metal.

mlx-lm's `gated_delta_update` picks its Metal kernel or its ops by reading `mx.default_device()` and
`mx.metal.is_available()` through its module's `mx`, and calls its module's `gated_delta_kernel`.
`emulate` (for a fixture's monkeypatch) gives that module an `mx` that reports a Metal GPU and a
stand-in kernel with the kernel's interface that computes with mlx-lm's own ops and records each
call, and tells Dyno's `kernel_path` it is on Metal: the verify pass then takes its kernel branch
(replay tapes) exactly as on a Mac, with CPU arithmetic.
"""

from types import SimpleNamespace
from typing import List, Tuple

import mlx.core as mx
from mlx_lm.models import gated_delta

import speculative.target as target_mod


class MetalMLX:
    """mlx.core as mlx-lm's gated_delta module sees it on a Mac: the GPU is the default device and
    Metal is available; everything else is mlx.core's own."""

    metal = SimpleNamespace(is_available=lambda: True)

    @staticmethod
    def default_device():
        return mx.gpu

    def __getattr__(self, name):
        return getattr(mx, name)


class KernelStandIn:
    """`gated_delta_kernel`'s interface, (q, k, v, g, beta, state, mask) -> (y, state), computed by
    `gated_delta_ops`; `calls` holds each call's (q, k, v, g, beta, state) shapes."""

    def __init__(self):
        self.calls: List[Tuple[tuple, ...]] = []

    def __call__(self, q, k, v, g, beta, state, mask=None):
        self.calls.append(tuple(x.shape for x in (q, k, v, g, beta, state)))
        return gated_delta.gated_delta_ops(q, k, v, g, beta, state, mask)


def emulate(monkeypatch) -> KernelStandIn:
    """Make this process take Metal's Gated DeltaNet branch (undone with `monkeypatch`); returns the
    stand-in kernel, whose calls say when mlx-lm took it."""
    kernel = KernelStandIn()
    monkeypatch.setattr(gated_delta, "mx", MetalMLX())
    monkeypatch.setattr(gated_delta, "gated_delta_kernel", kernel)
    monkeypatch.setattr(target_mod, "on_metal", lambda: True)
    return kernel
