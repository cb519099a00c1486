"""Reading chosen tensors out of safetensors files without loading whole shards.

safetensors' own `framework="mlx"` reader goes through numpy, which has no bfloat16, and
mx.load reads every tensor of a file; heads live inside multi-GB shards, so we read the header
(the format's 8-byte length + JSON) and then only the byte ranges we need. Every malformed file
(truncated, corrupt header, missing tensor, unknown dtype) is a DynoError naming the file.
"""

import json
import os
import struct
from pathlib import Path
from typing import Dict, Iterable, Optional

import mlx.core as mx
import numpy as np

from ..errors import DynoError

INDEX = "model.safetensors.index.json"
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
    "F8_E4M3": (np.uint8, None),  # decoded by mx.from_fp8; block scales applied by dequantize_fp8
}
FP8_SCALE = "_scale_inv"  # Qwen's -FP8 releases: `<name>_scale_inv` beside each F8_E4M3 weight
FP8_BLOCK = 128  # their quantization_config.weight_block_size: [128, 128]


def read_header(path: Path) -> Dict[str, dict]:
    """The tensor table of a safetensors file: name -> {dtype, shape, data_offsets}."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (n,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (None,)
            # A corrupt length would make f.read allocate that many bytes: check it first.
            if n is None or n > size - 8:
                raise DynoError(f"safetensors file {path} is truncated or not a safetensors file "
                                f"({size} bytes{'' if n is None else f', header length {n}'})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise DynoError(f"cannot read safetensors file {path}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise DynoError(f"safetensors file {path} has a corrupt header: {e}") from None
    return check_table(header, str(path), data_size=size - 8 - n, base=8 + n)


def check_table(header, where: str, data_size: Optional[int] = None, base: int = 0) -> Dict[str, dict]:
    """A parsed safetensors header, checked entry by entry; each entry gets `_base` (data start)."""
    if not isinstance(header, dict):
        raise DynoError(f"safetensors file {where} has a corrupt header: not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        problem = _entry_problem(entry, data_size)
        if problem:
            raise DynoError(f"safetensors file {where} has a corrupt entry for {name}: {problem}")
        entry["_base"] = base
    return header


def _entry_problem(entry, data_size: Optional[int]) -> Optional[str]:
    """What is wrong with one header entry, or None."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    shape, offsets, dtype = entry.get("shape"), entry.get("data_offsets"), entry.get("dtype")
    if not isinstance(dtype, str):
        return f"dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return f"shape {shape!r}"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"data_offsets {offsets!r}"
    if data_size is not None and offsets[1] > data_size:
        return f"data ends at byte {offsets[1]} of a {data_size}-byte data section (truncated file?)"
    # Unknown dtypes (FP8 trunks) pass here: only the tensors actually read must be decodable.
    if dtype in DTYPES:
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype][0]).itemsize
        if offsets[1] - offsets[0] != want:
            return f"{offsets[1] - offsets[0]} bytes of data for {dtype}{shape} ({want} expected)"
    return None


def decode(raw: bytes, dtype: str, shape) -> mx.array:
    """Bytes of one tensor -> mx.array, checking the length against dtype and shape."""
    if dtype not in DTYPES:
        raise DynoError(f"unsupported tensor dtype {dtype}")
    np_dtype, mx_dtype = DTYPES[dtype]
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
    if len(raw) != expected:
        raise DynoError(f"tensor data is {len(raw)} bytes, expected {expected} for {dtype}{list(shape)}")
    arr = mx.array(np.frombuffer(raw, dtype=np_dtype).reshape(shape))
    if dtype == "F8_E4M3":
        return mx.from_fp8(arr, mx.bfloat16)
    return arr.view(mx_dtype) if mx_dtype == mx.bfloat16 else arr


def dequantize_fp8(tensors: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """FP8 weights with block scales -> bf16: each block of the weight times its `_scale_inv`.

    Blocks are FP8_BLOCK x FP8_BLOCK, the edge ones partial. Other tensors pass through; scales
    that do not match the weight's blocks are a DynoError.
    """
    out = {}
    for name, v in tensors.items():
        if name.endswith(FP8_SCALE) and name[: -len(FP8_SCALE)] in tensors:
            continue
        scale = tensors.get(name + FP8_SCALE)
        if scale is not None:
            v = _apply_block_scale(name, v, scale)
        out[name] = v
    return out


def _apply_block_scale(name: str, w: mx.array, scale: mx.array) -> mx.array:
    if w.ndim != 2 or scale.ndim != 2:
        raise DynoError(f"{name} has shape {list(w.shape)} with scales {list(scale.shape)}: not 2-D FP8 blocks")
    if [-(-d // FP8_BLOCK) for d in w.shape] != list(scale.shape):
        raise DynoError(f"{name} has shape {list(w.shape)}; its scales {list(scale.shape)} are not one per "
                        f"{FP8_BLOCK} x {FP8_BLOCK} block")
    full = mx.repeat(mx.repeat(scale.astype(mx.float32), FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
    return (w.astype(mx.float32) * full[: w.shape[0], : w.shape[1]]).astype(mx.bfloat16)


def read_tensors(path: Path, names: Iterable[str],
                 header: Optional[Dict[str, dict]] = None) -> Dict[str, mx.array]:
    """Read just `names` from one safetensors file (`header`: its read_header, if already read)."""
    header = read_header(path) if header is None else header
    out = {}
    try:
        with open(path, "rb") as f:
            for name in names:
                if name not in header:
                    raise DynoError(f"safetensors file {path} has no tensor {name}")
                entry = header[name]
                start, end = entry["data_offsets"]
                f.seek(entry["_base"] + start)
                try:
                    out[name] = decode(f.read(end - start), entry["dtype"], entry["shape"])
                except DynoError as e:
                    raise DynoError(f"cannot read {name} from {path}: {e.message}") from None
    except OSError as e:
        raise DynoError(f"cannot read safetensors file {path}: {e.strerror or e}") from None
    return out


def read_index(path: Path) -> Dict[str, str]:
    """The weight_map (tensor name -> shard file) of a model.safetensors.index.json."""
    try:
        weight_map = json.loads(Path(path).read_text())["weight_map"]
    except OSError as e:
        raise DynoError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError) as e:  # bad JSON, no weight_map, not an object
        raise DynoError(f"{path} is not a valid safetensors index: {type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise DynoError(f"{path} is not a valid safetensors index: weight_map is not tensor name -> file")
    return weight_map


def checkpoint_files(folder: Path) -> Dict[str, Path]:
    """Tensor name -> the file holding it, for a sharded (index) or single-file checkpoint."""
    index = folder / INDEX
    if index.exists():
        return {k: folder / v for k, v in read_index(index).items()}
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        for name in read_header(path):
            files[name] = path
    return files
