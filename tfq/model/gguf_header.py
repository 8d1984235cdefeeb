"""Read a GGUF file's header: its metadata and tensor table (name, dims, ggml type, byte range).

The header is parsed here directly: `gguf.GGUFReader` builds a numpy view per vocabulary string and takes
seconds on a 150k-token file, while `model_config` must be fast.
"""
from __future__ import annotations

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


class _Cursor:
    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="surrogateescape")
        self.pos = end
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise struct.error("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).tolist()
                self.pos = end
                return arr
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_header(path: Path) -> GgufHeader:
    """Metadata and tensor table of a GGUF file; TfqError if it is not one or is cut short."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise TfqError(f"{path}: too short to be a GGUF file ({size} bytes); the file may be truncated")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                header = _parse(path, mm, size)
    except OSError as e:
        raise TfqError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None
    end = max((t.offset + t.n_bytes for t in header.tensors), default=0)
    if end > size:
        raise TfqError(
            f"{path}: truncated GGUF file: its tensors need {end:,} bytes but the file has {size:,}; "
            "download or copy it again"
        )
    return header


def _parse(path: Path, mm, size: int) -> GgufHeader:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if mm[:4] != MAGIC:
        raise TfqError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    c = _Cursor(mm, 4)
    try:
        version = c.scalar("<I")
        if version not in (2, 3):
            raise TfqError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            metadata[key] = c.value(c.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.scalar("<I")
            dims = tuple(c.scalar("<Q") for _ in range(n_dims))
            raw.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
    except (struct.error, ValueError, IndexError) as e:
        raise TfqError(f"{path}: the GGUF header is cut short or damaged ({e}); the file may be truncated") from None
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = (c.pos + align - 1) // align * align
    tensors = []
    for name, dims, gtype, rel in raw:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        except (ValueError, KeyError):
            raise TfqError(f"{path}: tensor {name} has unknown ggml type {gtype}") from None
        n_bytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
        tensors.append(TensorInfo(name, dims, gtype, data_start + rel, n_bytes))
    return GgufHeader(path, version, metadata, tensors, size)
