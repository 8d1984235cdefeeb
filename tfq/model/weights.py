"""Safetensors in and out: read a checkpoint folder's weights as float32, stream fp32 tensors to a file."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from tfq.errors import TfqError

INDEX = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint folder: those its index names, else every *.safetensors."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TfqError(f"{index}: not a readable safetensors index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise TfqError(f"{index} names {', '.join(missing)}, which is not in {folder}; "
                           "the checkpoint is incomplete")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TfqError(f"{folder}: no *.safetensors weights there; tfq reads HF checkpoints saved as safetensors")
    return files


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `folder`, by its HF name, as float32, all in memory."""
    lazy = lazy_state_dict(folder)
    return {name: lazy[name] for name in lazy}


def write_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    tensors: Iterable[tuple[str, np.ndarray]],
    progress: bool = True,
    desc: str = "writing",
) -> None:
    """Write fp32 tensors to one safetensors file, one at a time (never all in memory).

    `shapes` gives every tensor's name and shape up front (the header comes first); `tensors` yields
    (name, float32 array) in the same order.
    """
    from tqdm import tqdm

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        n = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    order = list(shapes)
    with open(path, "wb") as f, tqdm(
        total=offset, unit="B", unit_scale=True, desc=desc, disable=not progress, leave=False
    ) as bar:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        i = -1
        for i, (name, arr) in enumerate(tensors):
            if i >= len(order) or name != order[i] or tuple(arr.shape) != tuple(shapes[name]):
                raise ValueError(f"tensor {name} {tuple(arr.shape)} is not the next one the header announced")
            data = np.ascontiguousarray(arr, dtype="<f4")
            f.write(memoryview(data).cast("B"))
            bar.update(data.nbytes)
        if i + 1 != len(order):
            raise ValueError(f"{len(order) - i - 1} tensors announced in the header were never written")


def lazy_state_dict(folder: Path):
    """The checkpoint's tensors by HF name as float32, each read from its file when taken (LazyTensors), so a
    model loads with one tensor in its read form at a time beside what it keeps."""
    from safetensors import SafetensorError, safe_open

    from tfq.model.lazy import LazyTensors

    where: dict[str, Path] = {}
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in where:
                        raise TfqError(f"{path}: tensor {name} appears in two weight files")
                    where[name] = path
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise TfqError(f"{path}: not a readable safetensors file ({e}); "
                           "it may be truncated, copy it again") from None

    def read(name: str) -> torch.Tensor:
        try:
            with safe_open(str(where[name]), framework="pt") as f:
                t = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise TfqError(f"{where[name]}: tensor {name} is not readable ({e}); it may be truncated, copy it "
                           f"again") from None
        return t if t.dtype == torch.float32 else t.to(torch.float32)

    return LazyTensors(list(where), read)
