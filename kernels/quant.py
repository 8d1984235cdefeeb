"""GGUF-quantized weights kept in their blocks, and the linear layer that computes with them (kernels/cpu/quant.cpp).

Every weight of the formats tfq computes with (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is
w = fma(float(q - zero), s, o): q a small integer, s one fp32 scale per group of 16 or 32 inputs, o -0, the
block's min (Q4_1, Q5_1) or the group's min negated (Q4_K, Q5_K). Those
three arrays (`Quantized`) are what a GGUF block holds, spread out; the C++ kernel packs them into panels of 64
outputs at the file's bit width and unpacks them to fp32 only in registers. The unpacked value is the gguf
package's dequantized weight to the bit, and the sum is tfq's fp32 recipe, so `QuantLinear` gives the bits
`FixedOrderLinear` gives on the dequantized weights (docs/contract.md, section 3; docs/quantized.md).

MLX's affine groups (tfq/model/mlx.py) are kept the same way with their own rounding: MLX computes
w = round(round((q - zero) * s) + o) in its scales' dtype, so `rounding` is "fp32" (the product and the sum
each rounded in fp32) or "bf16" (each rounded to bf16); GGUF's is "fma".

This module reads block bytes with numpy and imports nothing from the engine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from . import cpu_build

# GGUF type name -> (bytes a block, weights a block)
BLOCKS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
          "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}
FORMATS = tuple(BLOCKS)
# GGUF type name -> (bits of q, inputs a scale, whether groups carry an offset), as `from_blocks` keeps them
ROUNDINGS = {"fma": 0, "fp32": 1, "bf16": 2}  # how a weight is unpacked (the kernel's Header::rounding)
KEPT = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q5_0": (5, 32, False), "Q5_1": (5, 32, True),
        "Q8_0": (8, 32, False), "Q4_K": (4, 32, True), "Q5_K": (5, 32, True), "Q6_K": (6, 16, False)}
SUPER = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # the K formats' super blocks: their scales are kept in two levels


def kept_bytes(bits: int, group: int, offsets: bool, n: int, k: int, super_block: int = 0) -> int:
    """Bytes an [n, k] matrix takes kept as one segment of kernels/cpu/quant.cpp's blob: its 64-byte header, then
    panels of 64 outputs (the last one padded), each group's integers at `bits` with an fp32 scale (and offset)
    per output, or, with a super block, an int8 one per group and an fp32 one per super block."""
    per_group = (1 if super_block else 4) * 64 * (2 if offsets else 1) + group * ROW_BYTES[bits]
    supers = k // super_block * 4 * 64 * (2 if offsets else 1) if super_block else 0
    return 64 + -(-n // 64) * (supers + k // group * per_group)


def kept_bytes_q8(bits: int, group: int, offsets: bool, n: int, k: int, super_block: int = 0) -> int:
    """kept_bytes for kernels/cpu/quant_q8.cpp's layout (activations rounded to 8 bits): panels of 16 outputs,
    each group's integers at `bits`, its scales as in kept_bytes."""
    per_group = (1 if super_block else 4) * 16 * (2 if offsets else 1) + 16 * group * bits // 8
    supers = k // super_block * 4 * 16 * (2 if offsets else 1) if super_block else 0
    return 64 + -(-n // 16) * (supers + k // group * per_group)


def format_bytes(kind: str, n: int, k: int, activations: str = "fp32") -> int:
    """kept_bytes of an [n, k] matrix of GGUF type `kind`, as from_blocks keeps it (for `activations`)."""
    return (kept_bytes_q8 if activations == "q8" else kept_bytes)(*KEPT[kind], n, k, SUPER.get(kind, 0))


ROW_BYTES = {4: 32, 5: 40, 6: 48, 8: 64}  # one input's integers for a panel's 64 outputs


@dataclass
class Levels:
    """A K format's scales in the file's two levels: s = d * sub and o = -(dmin * sub_min), exact products
    (an fp16 times a 6- or 8-bit integer), with d and dmin per super block of `block` inputs, sub and sub_min
    (int8) per group."""

    d: torch.Tensor  # fp32 [n, k / block]
    sub: torch.Tensor  # int8 [n, k / group]
    dmin: torch.Tensor | None
    sub_min: torch.Tensor | None
    block: int

    def select(self, ids: torch.Tensor) -> "Levels":
        pick = lambda t: None if t is None else t[ids]  # noqa: E731
        return Levels(self.d[ids], self.sub[ids], pick(self.dmin), pick(self.sub_min), self.block)

    def args(self) -> tuple:
        c = lambda t: None if t is None else t.contiguous()  # noqa: E731
        return c(self.d), c(self.sub), c(self.dmin), c(self.sub_min)


@dataclass
class Quantized:
    """A weight matrix [n, k] as integers q (uint8 [n, k]; int8 bit patterns when bits is 8), scales s and
    offsets o (fp32 [n, k / group]; o None means -0): w = fma(float(q - zero), s, o)."""

    q: torch.Tensor
    s: torch.Tensor
    o: torch.Tensor | None
    bits: int  # 4, 5, 6 or 8 (8: q is signed)
    group: int  # inputs sharing a scale: 32, or 16 (Q6_K)
    zero: int  # subtracted from q: 8 (Q4_0), 16 (Q5_0), 32 (Q6_K), 0 (Q8_0, Q4_K); MLX 8-bit: -128
    kind: str  # the GGUF type it came from, or "MLX"
    rounding: str = "fma"  # fma (GGUF: one rounding), fp32 or bf16 (MLX: the product and the sum each rounded)
    levels: "Levels | None" = None  # the K formats' scales as the file holds them (s and o are their products)
    activations: str = "fp32"  # fp32, or q8: rounded to 8 bits per block of 32 (kernels/cpu/quant_q8.cpp)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def nbytes(self) -> int:
        """Bytes a forward reads: the integers at their width, the scales and offsets."""
        count = kept_bytes_q8 if self.activations == "q8" else kept_bytes
        return count(self.bits, self.group, self.o is not None, *self.shape, self.levels.block if self.levels else 0)

    def with_activations(self, activations: str) -> "Quantized":
        """The matrix computed with activations `activations` (q8 only for GGUF's formats: one rounding)."""
        if activations == "q8" and self.rounding != "fma":
            raise ValueError(f"activations q8 are for GGUF's formats, not {self.kind}")
        return dataclasses.replace(self, activations=activations)

    def ints(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """q - zero as int32, of rows `ids` or all of them."""
        q = self.q if ids is None else self.q[ids]
        return (q.view(torch.int8) if self.bits == 8 else q).to(torch.int32) - self.zero

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 weights of rows `ids` (an embedding lookup): the kernel's value, q - zero times s (exact but
        for Q6_K, where it rounds once as fma does), plus o (-0 changes nothing; Q4_K rounds once here). MLX's
        roundings: the product, then the sum, each rounded (in bf16, torch rounds each result as MLX does)."""
        q = self.ints(ids)
        s = self.s[ids].repeat_interleave(self.group, -1)
        if self.rounding == "bf16":
            s = s.to(torch.bfloat16)
        w = q.to(s.dtype) * s
        if self.o is not None:
            w = w + self.o[ids].repeat_interleave(self.group, -1).to(s.dtype)
        return w.float()

    def select(self, ids: torch.Tensor) -> "Quantized":
        """Rows `ids` of the matrix, still quantized (a hybrid's q_proj splits into queries and gates)."""
        return Quantized(self.q[ids], self.s[ids], None if self.o is None else self.o[ids], self.bits, self.group,
                         self.zero, self.kind, self.rounding, self.levels and self.levels.select(ids),
                         self.activations)

    def dequantized(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0]))

    @staticmethod
    def inputs_movable(order, group: int) -> bool:
        """Whether an order of inputs moves whole groups of `group` inputs (and so keeps a matrix quantized)."""
        chunks = torch.as_tensor(order).reshape(-1, group)
        starts = chunks[:, 0]
        return not bool((starts % group != 0).any()) and torch.equal(chunks - starts[:, None],
                                                                     torch.arange(group).expand_as(chunks))

    def permute_inputs(self, order: torch.Tensor) -> "Quantized | None":
        """The matrix with its inputs (columns) in `order`, still quantized when `order` moves whole groups (the
        K formats' super blocks are given up: each group keeps its fp32 scale); None when it cuts a group."""
        if not Quantized.inputs_movable(order, self.group):
            return None
        groups = order.reshape(-1, self.group)[:, 0] // self.group
        return Quantized(self.q[:, order].contiguous(), self.s[:, groups].contiguous(),
                         None if self.o is None else self.o[:, groups].contiguous(), self.bits, self.group,
                         self.zero, self.kind, self.rounding, activations=self.activations)


def from_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> Quantized:
    """A GGUF tensor's block bytes (uint8, rows of whole blocks) as `Quantized` [n, k]."""
    size, per = BLOCKS[kind]
    n, k = shape
    if k % per:
        raise ValueError(f"a {kind} row of {k} inputs is not whole blocks of {per}")
    b = np.ascontiguousarray(raw).reshape(n * k // per, size)
    f16 = lambda col: b[:, col:col + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731
    bits, group, _ = KEPT[kind]
    o = None
    if kind == "Q8_0":
        q, s, zero = b[:, 2:].copy(), f16(0), 0
    elif kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        qs = b[:, -16:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1)
        five = kind.startswith("Q5")
        if five:
            start = 4 if kind == "Q5_1" else 2
            qh = b[:, start:start + 4].copy().view(np.uint32)
            q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        s = f16(0)
        zero = 0 if kind.endswith("_1") else 16 if five else 8
        if kind.endswith("_1"):  # w = d q + m
            o = f16(2)
    elif kind in ("Q4_K", "Q5_K"):  # w = (d sc) q - (dmin m) per 32
        d, dmin = f16(0), f16(2)
        sc, m = _k_scale_min(b[:, 4:16])
        qs = b[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 15).reshape(-1, 256)
        if kind == "Q5_K":
            qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & 1).reshape(-1, 256) << 4)
        s = (d * sc.astype(np.float32)).reshape(-1, 8)
        o = -(dmin * m.astype(np.float32)).reshape(-1, 8)
        zero = 0
        levels = (d, sc, dmin, m)
    else:  # Q6_K
        ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((ql & 15).reshape(-1, 256) | ((qh & 3).reshape(-1, 256) << 4)).astype(np.uint8)
        sc = b[:, 192:208].copy().view(np.int8)
        s = f16(208) * sc.astype(np.float32)
        zero = 32
        levels = (f16(208), sc, None, None)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(n, -1)  # noqa: E731
    # astype(copy=False) below: a table's q is already uint8 and its own copy (a second would be 136 MB a head)
    kept = None
    if kind in SUPER:
        d, sc, dmin, m = levels
        i8 = lambda a: t(a.astype(np.int8))  # noqa: E731  (6-bit scales and mins, or Q6_K's int8 ones)
        kept = Levels(t(d.astype(np.float32)), i8(sc), None if dmin is None else t(dmin.astype(np.float32)),
                      None if m is None else i8(m), SUPER[kind])
    f32 = lambda a: t(a.astype(np.float32, copy=False))  # noqa: E731
    return Quantized(t(q.astype(np.uint8, copy=False)), f32(s), None if o is None else f32(o),
                     bits, group, zero, kind, levels=kept)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes a block -> 8 six-bit scales and 8 six-bit mins (llama.cpp's packing)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def joinable(parts: list) -> bool:
    """Whether these matrices stack into one quantized layer: when all are quantized (each keeps its format)."""
    return all(isinstance(p, (Quantized, Stacked)) for p in parts)


@dataclass
class Stacked:
    """Quantized matrices one under the other, each in its own format (q, k and v of one layer): one layer whose
    blob holds a segment a part (kernels/cpu/quant.cpp), so no part is widened."""

    parts: list[Quantized]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


def join(parts: list) -> "Quantized | Stacked":
    """Matrices stacked by rows (q, k, v into one layer), each kept as it is: one segment of the blob a part."""
    flat = [q for p in parts for q in (p.parts if isinstance(p, Stacked) else [p])]
    return flat[0] if len(flat) == 1 else Stacked(flat)


def pack(weight: Quantized) -> torch.Tensor:
    """One matrix as one segment of a blob (kernels/cpu/quant.cpp's qpack, or quant_q8.cpp's qpack_q8)."""
    levels = weight.levels.args() if weight.levels is not None else (None, None, None, None)
    if weight.activations == "q8":
        return cpu_build.op("qpack_q8")(weight.q.contiguous(), weight.s.contiguous(),
                                        None if weight.o is None else weight.o.contiguous(),
                                        weight.bits, weight.group, weight.zero, *levels)
    return cpu_build.op("qpack")(weight.q.contiguous(), weight.s.contiguous(),
                                 None if weight.o is None else weight.o.contiguous(),
                                 weight.bits, weight.group, weight.zero, ROUNDINGS[weight.rounding], *levels)


class QuantLinear:
    """y = x W^T + b on quantized weights, by kernels/cpu/quant.cpp: the bits FixedOrderLinear gives on the
    dequantized weights. `panels` is the packed blob (uint8), which the one-call layer takes like fp32 panels."""

    def __init__(self, weight: "Quantized | Stacked", bias: torch.Tensor | None = None):
        parts = weight.parts if isinstance(weight, Stacked) else [weight]
        self.out_features, self.in_features = weight.shape
        kinds = {p.kind for p in parts}
        self.kind = kinds.pop() if len(kinds) == 1 else "mixed"
        self.bits, self.nbytes = max(p.bits for p in parts), weight.nbytes()
        blobs = [pack(p) for p in parts]
        self.panels = cpu_build.op("qcat")(blobs)  # kept: a small one beside the others (kernels/cpu/memory.h)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_build.op("qlinear")(x.contiguous(), self.panels, self.bias, self.out_features)
