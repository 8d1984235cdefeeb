"""One result of the kernel check, and the bit comparison every proof uses."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass
class Case:
    check: str
    kernel: str
    backend: str
    dtype: str
    ok: bool  # a check passed, or a control came out RED
    worst: float | None = None
    bound: float | None = None
    note: str = ""
    control: bool = False

    @property
    def result(self) -> str:
        if self.control:
            return "RED" if self.ok else "GREEN (control did not fail)"
        return "PASS" if self.ok else "FAIL"


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    if flat.numel() * flat.element_size() % 4 == 0:
        return flat.view(torch.int32)  # torch.equal is fastest on 4-byte words
    return flat.view(_INT_VIEW[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
