"""Damaging the prompt cache's disk-tier files the way a disk can: array bytes flipped under an intact header."""

import json
import struct


def header(path):
    """(header length, the safetensors header) of a file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def flip_array_bytes(path, prefix="trunk."):
    """Invert 256 bytes in the middle of the data of every array whose name starts with `prefix`,
    the header left as it was; returns the names of the arrays flipped."""
    n, head = header(path)
    data = bytearray(path.read_bytes())
    names = [k for k in head if k.startswith(prefix)]
    for name in names:
        begin, end = (8 + n + o for o in head[name]["data_offsets"])
        mid = (begin + end) // 2
        for i in range(max(mid - 128, begin), min(mid + 128, end)):
            data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return names
