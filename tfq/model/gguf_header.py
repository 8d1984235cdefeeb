"""Read a GGUF file's header: its metadata and tensor table (name, dims, ggml type, byte range).

The header is parsed here directly: `gguf.GGUFReader` builds a numpy view per vocabulary string and takes
seconds on a 150k-token file, while `model_config` must be fast.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tfq.errors import TfqError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> struct format (scalars); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order (fastest-varying first), as ggml's ne
    ggml_type: int
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (torch) shape: GGUF dims reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    file_size: int

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)

    def count(self, key: str, default: int | None = None, least: int = 1) -> int:
        """A size or count from the metadata: an integer from `least` to 2^32 - 1 (as llama.cpp reads them),
        else a one-line TfqError naming the key (a 0 divides, and 2^60 layers loop, further on)."""
        v = self.metadata.get(key, default)
        if v is None:
            raise TfqError(f"{self.path}: GGUF metadata lacks {key}; the file is not a complete model")
        if isinstance(v, bool) or not isinstance(v, int) or not least <= v <= MAX_COUNT:
            raise TfqError(f"{self.path}: GGUF metadata {key} = {v!r:.40} is not an integer from {least} to "
                           f"{MAX_COUNT:,}; the file is damaged: download or convert it again")
        return v


# The fewest bytes an entry of the header can take: a key (8-byte length, 4-byte type, a 1-byte value), a tensor
# (8-byte name length, 4-byte n_dims, one 8-byte dim, 4-byte type, 8-byte offset), an array's element. A count
# the rest of the file cannot hold is refused before anything is built from it.
_LEAST_KEY, _LEAST_TENSOR = 13, 32
_LEAST_ELEMENT = {_STRING: 8, **{t: struct.calcsize(f) for t, f in _SCALARS.items()}}
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_COUNT = 2**32 - 1  # llama.cpp reads every size and count key as a uint32


class _Cursor:
    def __init__(self, path: Path, buf, pos: int = 0):
        self.path, self.buf, self.pos = path, buf, pos

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def count(self, what: str, least_bytes: int) -> int:
        """A u64 count of entries of at least `least_bytes` each, refused when the rest of the file cannot hold
        them (a crafted count would otherwise build millions of entries, or loop, before the file runs out)."""
        n = self.scalar("<Q")
        if n * least_bytes > len(self.buf) - self.pos:
            raise TfqError(f"{self.path}: the GGUF header is cut short or damaged: {what} is {n:,}, more than "
                           f"the file's {len(self.buf):,} bytes hold; download or copy it again")
        return n

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="surrogateescape")
        self.pos = end
        return s

    def value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I")
            if etype not in _LEAST_ELEMENT:  # llama.cpp reads no arrays of arrays either
                raise ValueError(f"{key} is an array of GGUF value type {etype}")
            count = self.count(f"the length of array {key}", _LEAST_ELEMENT[etype])
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).tolist()
                self.pos += count * dt.itemsize
                return arr
            return [self.string() for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_header(path: Path) -> GgufHeader:
    """Metadata and tensor table of a GGUF file; TfqError if it is not one, is cut short, or states a count or a
    size its bytes do not hold."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise TfqError(f"{path}: too short to be a GGUF file ({size} bytes); the file may be truncated")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(path, mm, size)
    except OSError as e:
        raise TfqError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None


def _parse(path: Path, mm, size: int) -> GgufHeader:
    if mm[:4] != MAGIC:
        raise TfqError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    c = _Cursor(path, mm, 4)
    try:
        version = c.scalar("<I")
        if version not in (2, 3):
            raise TfqError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        n_tensors = c.scalar("<Q")
        n_kv = c.count("the number of metadata keys", _LEAST_KEY)
        if n_tensors * _LEAST_TENSOR > size - c.pos:
            raise TfqError(f"{path}: the GGUF header is cut short or damaged: it lists {n_tensors:,} tensors, more "
                           f"than the file's {size:,} bytes hold; download or copy it again")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            metadata[key] = c.value(c.scalar("<I"), key)
        raw = [_tensor_entry(c) for _ in range(n_tensors)]
    except (struct.error, ValueError, IndexError) as e:
        raise TfqError(f"{path}: the GGUF header is cut short or damaged ({e}); the file may be truncated") from None
    align = _alignment(path, metadata)
    data_start = (c.pos + align - 1) // align * align
    tensors = [_tensor(path, name, dims, gtype, rel, data_start, align, size) for name, dims, gtype, rel in raw]
    return GgufHeader(path, version, metadata, tensors, size)


def _tensor_entry(c: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string()
    n_dims = c.scalar("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions; ggml's have 1 to {MAX_DIMS}")
    dims = tuple(c.scalar("<Q") for _ in range(n_dims))
    return name, dims, c.scalar("<I"), c.scalar("<Q")


def _alignment(path: Path, metadata: dict[str, Any]) -> int:
    """general.alignment: a power of two (the data's start and every tensor's offset are multiples of it)."""
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise TfqError(f"{path}: GGUF metadata general.alignment = {align!r:.40} is not a power of two; the file "
                       f"is damaged: download or convert it again")
    return align


def _tensor(path: Path, name: str, dims: tuple[int, ...], gtype: int, rel: int, data_start: int, align: int,
            size: int) -> TensorInfo:
    """One tensor's entry, its byte count in Python integers (an int64 product wraps: (32, 2^29, 2^34) is 0),
    refused unless its dims are whole blocks of its type and its bytes lie inside the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
    except (ValueError, KeyError):
        raise TfqError(f"{path}: tensor {name} has unknown ggml type {gtype}") from None
    if 0 in dims or dims[0] % block:
        what = "a dimension of 0" if 0 in dims else f"a first dimension that is not whole {block}-element blocks"
        raise TfqError(f"{path}: tensor {name} has dims {dims}, {what}; the file is damaged: download or convert "
                       f"it again")
    n_bytes = math.prod(dims) // block * type_size
    offset = data_start + rel
    if rel % align:
        raise TfqError(f"{path}: tensor {name} starts at {rel:,}, not a multiple of general.alignment ({align}); "
                       f"the file is damaged: download or convert it again")
    if offset + n_bytes > size:
        raise TfqError(f"{path}: truncated GGUF file or damaged header: tensor {name} (dims {dims}) ends at byte "
                       f"{offset + n_bytes:,} but the file has {size:,}; download or copy it again")
    return TensorInfo(name, dims, gtype, offset, n_bytes)
