"""Which BLAS MLX's CPU backend multiplies float32 matrices with, so that every figure can say so.

The `mlx[cpu]` wheel links the reference BLAS it bundles (`mlx_cpu.libs/libblas-*.so.3.10.0`, netlib):
its `cblas_sgemm` runs at about 2 GFLOP/s and its cost grows with every row, so products are
compute-bound. A BLAS preloaded with LD_PRELOAD (tools/with_openblas.sh) comes first in the dynamic
linker's global scope and replaces those symbols, though the bundled one stays mapped; so this asks
the linker which object `cblas_sgemm` resolves to, as it resolves MLX's own calls: the global scope
first, then MLX's library and its dependencies. On macOS that is Accelerate (and products on the
default device run on Metal, through no BLAS).
"""

import ctypes
import os
import sys
from dataclasses import asdict, dataclass
from typing import Optional

SYMBOL = "cblas_sgemm"
# What a reference BLAS means for the figures: one line for `dyno bench` and the tools' tables.
# bf16 and quantized products are MLX's own CPU kernels (measured: no faster with OpenBLAS preloaded).
REFERENCE_NOTE = ("note: float32 products run compute-bound here (reference BLAS, cost linear in rows; bf16 and "
                  "quantized ones in MLX's own CPU kernels), so verify rows cost nearly their tokens, unlike "
                  "bandwidth-bound decoding on a Mac; tools/with_openblas.sh runs a command with OpenBLAS")


@dataclass(frozen=True)
class Blas:
    """The BLAS behind MLX's CPU float32 products: its name, the library file, whether it is the reference one."""

    name: str  # "OpenBLAS 0.3.21 ...", "reference BLAS (netlib, bundled with mlx[cpu])", "Accelerate", ...
    path: Optional[str]  # the shared object `cblas_sgemm` resolves to, None when it cannot be told
    reference: bool  # the netlib reference implementation: compute-bound, linear in rows
    device: str  # MLX's default device: where the products of a run actually go

    def line(self) -> str:
        """One line for a table header: the BLAS, its file, and where products run when not on the CPU."""
        where = "" if self.device.startswith("Device(cpu") else f"; products on {self.device}, not the CPU"
        return f"BLAS: {self.name} ({self.path or 'path unknown'}){where}"

    def as_json(self) -> dict:
        """The record's `blas` entry."""
        return asdict(self)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _library_of(address: int) -> Optional[str]:
    """The shared object holding `address` (dladdr), or None."""
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not libc.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def _address(handle: ctypes.CDLL) -> Optional[int]:
    try:
        return ctypes.cast(getattr(handle, SYMBOL), ctypes.c_void_p).value
    except AttributeError:  # not in this scope
        return None


def _mlx_library() -> Optional[str]:
    """The mapped file of MLX's core library (libmlx), read from /proc/self/maps; None off Linux."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmlx"):
                    return path
    except OSError:
        pass
    return None


def resolved_path() -> Optional[str]:
    """The library MLX's `cblas_sgemm` calls resolve to: the global scope's (a preload) first, else the one
    MLX's library brought with it."""
    import mlx.core  # noqa: F401  (loads libmlx and its BLAS)

    address = _address(ctypes.CDLL(None))
    if address is None and (mlx_lib := _mlx_library()):
        try:  # already loaded: RTLD_NOLOAD only hands back its handle, whose scope is it and its dependencies
            address = _address(ctypes.CDLL(mlx_lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            address = None
    return _library_of(address) if address else None


def _openblas_config(path: str) -> Optional[str]:
    """OpenBLAS's own description of its build ("OpenBLAS 0.3.21 DYNAMIC_ARCH ... MAX_THREADS=64") and threads."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        lib.openblas_get_config.restype = ctypes.c_char_p
        config = lib.openblas_get_config().decode().strip()
        return f"{config}, {lib.openblas_get_num_threads()} threads"
    except (OSError, AttributeError):
        return None


def name_of(path: Optional[str]) -> "tuple[str, bool]":
    """(name, is the reference BLAS) for a library file."""
    if path is None:
        return ("unknown (cblas_sgemm not found)", False)
    low = path.lower()
    if "openblas" in low:
        return (_openblas_config(path) or "OpenBLAS", False)
    if "mkl" in low:
        return ("Intel MKL", False)
    if "blis" in low:
        return ("BLIS", False)
    if "accelerate" in low or "veclib" in low:
        return ("Accelerate", False)
    if "mlx_cpu.libs" in low and "libblas" in low:
        return ("reference BLAS (netlib, bundled with mlx[cpu])", True)
    if os.path.basename(low).startswith("libblas"):  # a distribution's reference libblas.so.3
        return ("reference BLAS (netlib)", True)
    return (os.path.basename(path), False)


def detect() -> Blas:
    """The BLAS of this process's MLX CPU backend."""
    import mlx.core as mx

    path = resolved_path()
    name, reference = name_of(path)
    if sys.platform == "darwin" and path is None:
        name = "Accelerate"
    return Blas(name, path, reference, str(mx.default_device()))


def compute_bound_note(blas: Blas) -> Optional[str]:
    """The one line a run on Linux with the reference BLAS on the CPU prints under its figures, else None."""
    if sys.platform.startswith("linux") and blas.reference and blas.device.startswith("Device(cpu"):
        return REFERENCE_NOTE
    return None
