"""The device a Dyno process computes on, from $DYNO_DEVICE (the test suite pins its processes to the CPU)."""

import os

import mlx.core as mx

from speculative.errors import DynoError


def device_from_env() -> None:
    """Compute on the device $DYNO_DEVICE names ("cpu" or "gpu"); unset, on MLX's default (a Mac's GPU).
    The process entry points call it first (the test suite pins its subprocesses to the CPU so)."""
    name = os.environ.get("DYNO_DEVICE", "")
    if not name:
        return
    if name not in ("cpu", "gpu"):
        raise DynoError(f"DYNO_DEVICE must be cpu or gpu, not {name!r}")
    if not mx.is_available(getattr(mx, name)):
        raise DynoError(f"DYNO_DEVICE={name}: this MLX has no {name} backend")
    mx.set_default_device(getattr(mx, name))
