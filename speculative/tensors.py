"""Reading chosen tensors out of safetensors files without loading whole shards.

safetensors' own `framework="mlx"` reader goes through numpy, which has no bfloat16, and
mx.load reads every tensor of a file; heads live inside multi-GB shards, so we read the header
(the format's 8-byte length + JSON) and then only the byte ranges we need.
"""

import json
import struct
from pathlib import Path
from typing import Dict, Iterable

import mlx.core as mx
import numpy as np

from .errors import DynoError

# safetensors dtype -> (numpy storage dtype, mlx dtype)
DTYPES = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),
    "I64": (np.int64, mx.int64),
    "I32": (np.int32, mx.int32),
    "U32": (np.uint32, mx.uint32),
    "I8": (np.int8, mx.int8),
    "U8": (np.uint8, mx.uint8),
    "BOOL": (np.bool_, mx.bool_),
}


def read_header(path: Path) -> Dict[str, dict]:
    """The tensor table of a safetensors file: name -> {dtype, shape, data_offsets}."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise DynoError(f"cannot read safetensors file {path}: {e}") from None
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["_base"] = 8 + n
    return header


def decode(raw: bytes, dtype: str, shape) -> mx.array:
    """Bytes of one tensor -> mx.array, checking the length against dtype and shape."""
    if dtype not in DTYPES:
        raise DynoError(f"unsupported tensor dtype {dtype}")
    np_dtype, mx_dtype = DTYPES[dtype]
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
    if len(raw) != expected:
        raise DynoError(f"tensor data is {len(raw)} bytes, expected {expected} for {dtype}{list(shape)}")
    arr = mx.array(np.frombuffer(raw, dtype=np_dtype).reshape(shape))
    return arr.view(mx_dtype) if mx_dtype == mx.bfloat16 else arr


def read_tensors(path: Path, names: Iterable[str]) -> Dict[str, mx.array]:
    """Read just `names` from one safetensors file."""
    header = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name in names:
            entry = header[name]
            start, end = entry["data_offsets"]
            f.seek(entry["_base"] + start)
            out[name] = decode(f.read(end - start), entry["dtype"], entry["shape"])
    return out


def checkpoint_files(folder: Path) -> Dict[str, Path]:
    """Tensor name -> the file holding it, for a sharded (index) or single-file checkpoint."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise DynoError(f"cannot read {index}: {e}") from None
        return {k: folder / v for k, v in weight_map.items()}
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        for name in read_header(path):
            files[name] = path
    return files
