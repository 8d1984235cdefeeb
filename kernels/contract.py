"""What the kernels and the engine agree on: tile sizes, cache dtypes and their saturation, the attention
batch records, and the linear layer's type. The kernels import nothing else from tfq; the engine reaches them
only through these names and the Backend interface (kernels/backend.py). docs/contract.md says what every
kernel must keep.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# The version of tfq's arithmetic: raised when a kernel, the sampler or the digest gives other bits for the same
# inputs, so what was kept from before (a receipt, a page on disk) says it belongs to another recipe
RECIPE = 1
KEY_TILE = 64  # rows of keys one step of the online softmax reads; page rows must be a multiple of it
SPLIT_ROWS = 256  # rows of keys one split of the `partial` arithmetic covers (a multiple of KEY_TILE)
PANEL = 64  # outputs of one panel of an fp32 linear layer packed for tfq's CPU kernel (kernels/cpu/linear.cpp)

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
SATURATE = {"fp8": 448.0, "fp16": 65504.0}  # a store clamps instead of overflowing to inf/NaN

LinearFn = Callable[[torch.Tensor], torch.Tensor]  # rows [N, in] -> [N, out], each row on its own


@dataclass
class DecodeGroup:
    """Streams that each bring one query row to this forward."""

    q_rows: torch.Tensor  # [B] rows of the forward's q holding each stream's query
    cache_rows: torch.Tensor  # [B, Lpad] physical cache row of each key position (Lpad: tiles of the longest)
    lengths: torch.Tensor  # [B] keys each stream attends to (its query sits at position length - 1)
    memo: dict = field(default_factory=dict, repr=False)  # indices and masks, computed once per forward


@dataclass
class Chunk:
    """One stream bringing R >= 1 consecutive query rows (a prompt chunk, a draft verify)."""

    q_start: int  # first row of the forward's q
    count: int  # R
    first_pos: int  # position of the first query row
    cache_rows: torch.Tensor  # [Lpad] physical cache row of each key position up to first_pos + R
    memo: dict = field(default_factory=dict, repr=False)


@dataclass
class AttentionBatch:
    decode: DecodeGroup | None
    chunks: list[Chunk]
    partial: bool  # which arithmetic this forward runs
    memo: dict = field(default_factory=dict, repr=False)  # per forward: what every layer's attention reuses
