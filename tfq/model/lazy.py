"""A model's tensors by name, each read from its file when asked for and not kept: loading holds one matrix
(or one layer's few) in its read form at a time, beside what the model keeps, never the whole checkpoint."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterator


class LazyTensors(Mapping):
    """names -> tensors, read by `read(name)` on every access (a caller that needs a tensor twice reads it twice)."""

    def __init__(self, names: list[str], read: Callable[[str], object], norms_multiply: bool = False):
        self._names = {n: None for n in names}  # in the file's order
        self._read = read
        # a Qwen3.5 norm is given as the multiplier 1 + w (a GGUF file's), not as transformers' w
        self.norms_multiply = norms_multiply

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
