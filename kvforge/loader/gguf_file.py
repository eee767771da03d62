"""A GGUF file's header (metadata and tensor table) read in one pass, and its tensors' bytes read on request.

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata   key (u64 length + utf-8) | value type u32 | value
               (u8 i8 u16 i16 u32 i32 f32 bool string array u64 i64 f64; an array: element type u32, count u64,
               elements; a string: u64 length + utf-8)
    tensors    name | dims u32 | sizes u64 x dims (fastest first) | ggml type u32 | offset u64 (from the data start)
    padding    to general.alignment (32 by default)
    data       each tensor's bytes at its offset: rows of whole blocks

NOTE: the `gguf` package's reader keeps every element of a metadata array as numpy views of its own: for a
128k-token vocabulary with its merges that took 3.7 s and 310 MB. Here an array is one list of Python values.
Each tensor is mapped on its own (no copy out of the page cache) and unmapped once converted, so a load's resident
memory holds the tensor being converted, not the pages of every tensor read so far.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# metadata value type -> its little-endian numpy dtype
_NUMBERS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One entry of the tensor table; `shape` rows first (PyTorch order), the reverse of the file's."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int  # of its bytes in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """The metadata (key -> int, float, bool, str or a list of them) and tensor table of a GGUF file."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as handle:
            self._buffer = handle.read(min(os.fstat(handle.fileno()).st_size, 64 << 20))
            self._at = 0
            if self._take(4) != _MAGIC:
                raise ValueError("not a GGUF file (no GGUF magic)")
            version, num_tensors, num_fields = struct.unpack("<IQQ", self._take(20))
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version}")
            self.metadata: dict[str, Any] = {}
            for _ in range(num_fields):
                key = self._string()
                self.metadata[key] = self._value(self._u32())
            table = [self._tensor_entry() for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._at // alignment) * alignment
        self.tensors = [GGUFTensor(name, shape, qtype, data_start + offset, nbytes)
                        for name, shape, qtype, offset, nbytes in table]
        del self._buffer

    def read(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes, uint8 [*rows, bytes of a row]: a writable private mapping of them (writes never reach
        the file), unmapped once the last array of it is freed."""
        start = tensor.offset - tensor.offset % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as handle:
            if tensor.offset + tensor.nbytes > os.fstat(handle.fileno()).st_size:
                raise ValueError(f"{self.path}: tensor {tensor.name} runs past the end of the file")
            mapped = mmap.mmap(handle.fileno(), tensor.offset + tensor.nbytes - start, access=mmap.ACCESS_COPY,
                               offset=start)
        data = np.frombuffer(mapped, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset - start)
        rows = tensor.shape[:-1]
        return data.reshape(*rows, tensor.nbytes // max(int(np.prod(rows)), 1))

    def _take(self, size: int) -> bytes:
        if self._at + size > len(self._buffer):
            raise ValueError("GGUF header runs past the end of the file (or past 64 MiB)")
        chunk = self._buffer[self._at : self._at + size]
        self._at += size
        return chunk

    def _u32(self) -> int:
        return struct.unpack("<I", self._take(4))[0]

    def _u64(self) -> int:
        return struct.unpack("<Q", self._take(8))[0]

    def _string(self) -> str:
        return self._take(self._u64()).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            element, count = self._u32(), self._u64()
            if element == _STRING:
                return [self._string() for _ in range(count)]
            if element not in _NUMBERS:
                return [self._value(element) for _ in range(count)]
            return self._numbers(element, count).tolist()
        return self._numbers(kind, 1)[0].item()

    def _numbers(self, kind: int, count: int) -> np.ndarray:
        if kind not in _NUMBERS:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        dtype = np.dtype(_NUMBERS[kind])
        return np.frombuffer(self._take(dtype.itemsize * count), dtype=dtype)

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
        name = self._string()
        dims = [self._u64() for _ in range(self._u32())]
        try:
            qtype = GGMLQuantizationType(self._u32())
        except ValueError as e:
            raise ValueError(f"tensor {name!r} has an unknown ggml type: {e}") from e
        offset = self._u64()
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        numel = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block_size:
            raise ValueError(f"tensor {name!r}: rows of {dims[0]} are not whole blocks of {block_size}")
        return name, tuple(reversed(dims)), qtype, offset, numel // block_size * block_bytes
