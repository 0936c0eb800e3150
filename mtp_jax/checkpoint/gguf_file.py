"""A GGUF file's metadata and tensor table, read in one pass over its header (little-endian GGUF
versions 2 and 3), the tensors' bytes mapped from the file, not read, until asked for.

The ``gguf`` package's reader builds a numpy view per element of every metadata array: Gemma 3's
262,144-entry vocabulary (tokens, scores, types) took it 16.7 s on the project's CPU, most of a
270M model's load. Here numeric arrays are one ``np.frombuffer`` each and strings one slice each
(0.3 s). Dequantisation stays the ``gguf`` package's (:func:`gguf.quants.dequantize`), given each
tensor's bytes shaped as its reader shapes them.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np

# GGUF metadata value types -> numpy dtypes (8: string, 9: array)
_SCALARS = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (the message says where)."""


@dataclasses.dataclass
class GGUFTensorInfo:
    """One entry of the tensor table: ``shape`` in GGUF order (innermost first), ``offset`` from
    the file's start, ``n_bytes`` its stored size; ``data()``: its bytes as the ``gguf`` package's
    reader gives them (a float array for plain types, uint8 rows of blocks for quantised ones)."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    offset: int
    n_bytes: int
    _file: np.ndarray

    def data(self) -> np.ndarray:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        raw = self._file[self.offset : self.offset + self.n_bytes]
        dims = tuple(reversed(self.shape))
        plain = {
            GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F16: np.float16,
            GGMLQuantizationType.F64: np.float64,
        }
        if self.tensor_type in plain:
            return raw.view(plain[self.tensor_type]).reshape(dims)
        return raw.reshape(quant_shape_to_byte_shape(dims, self.tensor_type))  # BF16 too: bytes


class _Cursor:
    """Reads the header through ``mmap`` (struct on the mapped bytes: a 262k-token vocabulary in
    a fraction of a second)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def _need(self, n: int) -> None:
        if self.pos + n > self.size:
            end = self.pos + n
            raise GGUFFormatError(f"the header runs past the end of the file (byte {end} of {self.size})")

    def raw(self, n: int) -> bytes:
        self._need(n)
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self._need(size)
        (out,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        return self.raw(self.unpack("Q")).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.unpack("I"), self.unpack("Q")
            if inner == _STRING:
                return [self.string() for _ in range(count)]
            if inner not in _SCALARS:
                raise GGUFFormatError(f"array of value type {inner} is not supported")
            dtype = np.dtype(_SCALARS[inner]).newbyteorder("<")
            return np.frombuffer(self.raw(count * dtype.itemsize), dtype).tolist()
        if kind not in _SCALARS:
            raise GGUFFormatError(f"metadata value type {kind} is unknown")
        dtype = np.dtype(_SCALARS[kind]).newbyteorder("<")
        return np.frombuffer(self.raw(dtype.itemsize), dtype).tolist()[0]


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """(metadata key -> value, tensor name -> :class:`GGUFTensorInfo`) of the GGUF file ``path``;
    :class:`GGUFFormatError` on anything malformed (a tensor past the end of the file included)."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    with open(path, "rb") as f:
        header = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(_Cursor(header), buf)
    finally:
        header.close()


def _parse(c: _Cursor, buf: np.ndarray) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if c.raw(4) != b"GGUF":
        raise GGUFFormatError("not a GGUF file")
    version = c.unpack("I")
    if version not in (2, 3):
        raise GGUFFormatError(
            f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)"
        )
    n_tensors, n_kv = c.unpack("Q"), c.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.unpack("I"))
    table = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.unpack("Q") for _ in range(c.unpack("I")))
        try:
            kind = GGMLQuantizationType(c.unpack("I"))
        except ValueError as e:
            raise GGUFFormatError(f"tensor '{name}': {e}") from None
        table.append((name, dims, kind, c.unpack("Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-c.pos // align) * align
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, kind, offset in table:
        if name in tensors:
            raise GGUFFormatError(f"tensor '{name}' is listed twice")
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(dims, dtype=np.int64)) * size // block
        info = GGUFTensorInfo(name, kind, dims, start + offset, n_bytes, buf)
        if info.offset + n_bytes > buf.size:
            raise GGUFFormatError(
                f"tensor '{name}' ends at byte {info.offset + n_bytes} but the file has {buf.size}: truncated"
            )
        tensors[name] = info
    return metadata, tensors
