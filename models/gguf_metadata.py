"""``read_gguf``: a GGUF file's key/value header as a dict and its tensors memory-mapped, in one
pass; ``read_gguf_metadata``: the header alone.

``gguf.GGUFReader`` builds a numpy view for every element of every array, which costs ~3 s for
SmolLM2's 49k-token vocabulary and 49k merges on a 2-core machine; this reader walks the same
layout (the value types and magic come from the ``gguf`` package) and costs ~0.05 s. It reads only
the header, never the tensor data, so it is also the cheap way to validate a file before loading it.

Values come back as Python scalars and ``str``; arrays of numbers as numpy arrays; arrays of
strings as ``list[str]``.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Cursor:
    """A read position in the mapped file; every read checks it stays inside the file."""

    def __init__(self, buf: mmap.mmap, path: str):
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise ValueError(f"{self.path}: GGUF header is truncated or malformed at byte {start}")
        self.pos = start + n
        return start

    def scalar(self, fmt: str):
        s = struct.Struct(fmt)
        return s.unpack_from(self.buf, self.take(s.size))[0]

    def string(self) -> str:
        n = _U64.unpack_from(self.buf, self.take(8))[0]
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        append, unpack = out.append, _U64.unpack_from
        try:
            for _ in range(count):
                n = unpack(buf, pos)[0]
                pos += 8
                append(buf[pos : pos + n].decode("utf-8", errors="replace"))
                pos += n
        except struct.error:
            pos = len(buf) + 1
        if pos > len(buf):
            raise ValueError(f"{self.path}: GGUF string array is truncated at byte {self.pos}")
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        itype = self.scalar("<I")
        count = self.scalar("<Q")
        if itype == GGUFValueType.STRING:
            return self.strings(count)
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype])
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).copy()
        return [self.value(itype) for _ in range(count)]  # nested arrays: rare and small


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: ``shape`` outermost first (numpy's order; GGUF lists the
    innermost first), its ``tensor_type`` and ``data``, the raw bytes as a read-only memory map
    ``[rows, bytes per row]`` (what ``gguf.quants.dequantize`` takes)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray


def _read(path, with_tensors: bool):
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"{path}: too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, path)
            if cur.scalar("<I") != GGUF_MAGIC:
                raise ValueError(f"{path}: not a GGUF file (bad magic)")
            version = cur.scalar("<I")
            if version & 0xFFFF == 0:
                raise ValueError(f"{path}: big-endian GGUF files are not supported")
            if version not in (2, 3):
                raise ValueError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
            n_tensors = cur.scalar("<Q")  # the tensor infos follow the metadata
            n_kv = cur.scalar("<Q")
            metadata: dict[str, object] = {}
            for _ in range(n_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.scalar("<I"))
            if not with_tensors:
                return metadata, {}
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
                infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
            pos = cur.pos
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"{path}: general.alignment must be a positive int, got {align!r}")
    base = -(-pos // align) * align
    tensors = {}
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has an unknown type id {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        inner, rows = (dims[0] if dims else 1), math.prod(dims[1:])
        if inner % block:
            raise ValueError(
                f"{path}: tensor {name} rows of {inner} are not whole {qtype.name} blocks"
            )
        row_bytes = inner // block * type_size
        start = base + offset
        if start + rows * row_bytes > size:
            raise ValueError(f"{path}: tensor {name} lies past the end of the file (truncated?)")
        data = np.memmap(path, np.uint8, "r", offset=start, shape=(rows, row_bytes))
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, data)
    return metadata, tensors


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, object], dict[str, TensorInfo]]:
    """``(metadata, tensors by name)`` of the GGUF file at ``path``: the header parsed, the
    tensors memory-mapped, nothing else read. Errors as :func:`read_gguf_metadata`, and
    ValueError for a tensor of an unknown type, of partial blocks or past the file's end."""
    return _read(path, True)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, object]:
    """The key/value metadata of the GGUF file at ``path`` (little-endian GGUF v2/v3).

    Raises ``FileNotFoundError`` when there is no such file, and ``ValueError`` naming the path when
    it is not a GGUF file or its header is malformed.
    """
    return _read(path, False)[0]
