"""The kernel check's row-wise cases: a backend's linear layer and RMS norm give a row the same bits whatever
rows share the call (fewer rows, the same rows in another order), the same bits on every repeat, and stay
within a float64 bound. A control proves the batch check can fail: it must come out RED.

Where the backend has a quantized linear layer (weights: gguf), each GGUF format it computes with gets the same
cases on random blocks, plus one more: its bits equal the fp32 layer's on the dequantized weights (the gguf
package's values). Its control nudges one dequantized weight by one ulp where a one-hot input row shows it.

Shapes follow the check's heads and head size: hidden = heads x head_dim, a square layer and a 4x wider
down projection (the long rows that made oneDNN's lone row take another kernel on this CPU).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tfq.kernels.backend import Backend
from tfq.proofs.case import Case

U32 = 2.0 ** -24  # fp32 unit roundoff
ROW_COUNTS = (1, 2, 3, 8, 17)
ROWS = 33


def linear_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fp32 x W^T - float64 x W^T| <= (K + 2) u sum_k |x_k w_k| for any summation order (first order)."""
    return (x.shape[1] + 2) * U32 * (x.double().abs() @ w.double().abs().T)


def norm_bound(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm: the mean of squares carries (n + 2) u, the square root and reciprocal a few more, each
    relative; the result is off by at most (n/2 + 8) u relative, per element."""
    ref = _norm64(x, w, eps)
    return (x.shape[1] / 2 + 8) * U32 * ref.abs() + 1e-30


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _batch_ok(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, full: torch.Tensor) -> bool:
    """Fewer rows and reversed rows give every row its bits from the full call."""
    for m in ROW_COUNTS:
        if not torch.equal(f(x[:m]), full[:m]):
            return False
    return torch.equal(f(x.flip(0)), full.flip(0))


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks of `kind` for an [n, k] matrix: random integers, sub-scales and mins, fp16 scales of
    either sign sized so the weights are about a model's (a few hundredths)."""
    from tfq.kernels.quant import BLOCKS

    size, per = BLOCKS[kind]
    raw = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)
    scale = lambda s: (rng.uniform(0.5, 1.0, (len(raw), 1)) * rng.choice([-1, 1], (len(raw), 1)) * s)  # noqa: E731
    f16 = lambda a: a.astype(np.float16).view(np.uint8)  # noqa: E731
    if kind == "Q6_K":
        raw[:, 208:210] = f16(scale(1e-5))
    elif kind.endswith("_K"):
        raw[:, 0:2], raw[:, 2:4] = f16(scale(4e-5)), f16(scale(2e-5))
    else:
        raw[:, 0:2] = f16(scale(2e-3 if kind != "Q8_0" else 3e-4))
        if kind.endswith("_1"):
            raw[:, 2:4] = f16(scale(1e-2))
    return raw.reshape(n, -1)


def dequantized(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """The gguf package's fp32 values of a GGUF tensor's blocks (what weights: fp32 computes with)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32))


MLX_CASES = ((4, torch.bfloat16), (8, torch.float32))  # MLX's groups of 64: its two roundings tfq keeps


def random_mlx(bits: int, group: int, dtype: torch.dtype, n: int, k: int, g: torch.Generator):
    """A random MLX layer [n, k]: codes as uint32 words (one little-endian bit stream a row), scales of a few
    thousandths and biases of a few hundredths in `dtype`."""
    q = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.int64)
    stream = ((q.reshape(n, k, 1) >> torch.arange(bits)) & 1).reshape(n, -1)
    words = (stream.reshape(n, -1, 32) << torch.arange(32)).sum(-1)
    packed = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32)).view(torch.uint32)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(dtype)
    return packed, s, (torch.randn(n, k // group, generator=g) * 0.05).to(dtype)


def quantized_layers(n_out: int, n_in: int, rng, g):
    """(name, the quantized layer, the fp32 weights it must compute with) of each GGUF format, and of MLX's
    groups in each rounding (tfq.model.mlx: dequantized as MLX does)."""
    from tfq.kernels.quant import FORMATS, from_blocks
    from tfq.model.mlx import dequantize, kept

    for kind in FORMATS:
        raw = random_blocks(kind, n_out, n_in, rng)
        yield f"linear {kind}", from_blocks(kind, raw, (n_out, n_in)), dequantized(kind, raw, n_out, n_in)
    for bits, dtype in MLX_CASES:
        packed, s, o = random_mlx(bits, 64, dtype, n_out, n_in, g)
        yield (f"linear MLX {bits}-bit, {str(dtype).split('.')[1]} scales", kept(packed, s, o, 64, bits),
               dequantize(packed, s, o, 64, bits))


def check_quantized(backend: Backend, hidden: int, repeats: int, seed: int) -> list[Case]:
    """Each format: repeats, batch, bound (against the dequantized weights), equal to the fp32 layer on them."""
    from tfq.kernels.quant import FORMATS, from_blocks

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    n_in, n_out = -(-hidden // 256) * 256, hidden  # whole K-quant blocks
    cases = []
    for name, weights, w in quantized_layers(n_out, n_in, rng, g):
        b = torch.randn(n_out, generator=g)
        f = backend.quant_linear(weights, b)
        x = torch.randn(ROWS, n_in, generator=g)
        outs = [f(x) for _ in range(repeats)]
        full = outs[0]
        err = (full.double() - (x.double() @ w.double().T + b.double())).abs()
        bound = linear_bound(x, w) + U32 * b.double().abs()
        flags = {"repeats": all(torch.equal(o, full) for o in outs), "batch": _batch_ok(f, x, full),
                 "bound": bool((err <= bound).all()), "fp32": torch.equal(full, backend.linear(w, b)(x))}
        cases.append(Case("rows", name, backend.name, "fp32", all(flags.values()), err.max().item(),
                          bound.max().item(), _notes(flags)))
    cases += check_q8(backend, n_out, n_in, repeats, rng, g)
    kind = FORMATS[-1]
    raw = random_blocks(kind, n_out, n_in, rng)
    w = dequantized(kind, raw, n_out, n_in)
    nudged = w.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(float("inf")))
    one_hot = torch.zeros(2, n_in)
    one_hot[0, 5] = 1.0  # without a bias, row 0's output 3 is w[3, 5] itself: one ulp off shows, by construction
    plain = backend.quant_linear(from_blocks(kind, raw, (n_out, n_in)), None)
    cases.append(Case("control: fp32 weights one ulp off", f"linear {kind}", backend.name, "fp32",
                      not torch.equal(plain(one_hot), backend.linear(nudged, None)(one_hot)), control=True,
                      note="must fail: fp32"))
    return cases


def check_rowwise(backend: Backend, heads: int, head_dim: int, repeats: int, seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    dev = backend.device
    hidden = heads * head_dim
    cases = []
    for name, (n_in, n_out) in (("linear", (hidden, hidden)), ("linear (down)", (4 * hidden, hidden))):
        w = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
        b = torch.randn(n_out, generator=g)
        x = torch.randn(ROWS, n_in, generator=g)
        f = backend.linear(w.to(dev), b.to(dev))
        xd = x.to(dev)
        outs = [f(xd) for _ in range(repeats)]
        full = outs[0]
        err = (full.cpu().double() - (x.double() @ w.double().T + b.double())).abs()
        bound = linear_bound(x, w) + U32 * b.double().abs()  # the bias adds one rounding
        flags = {"repeats": all(torch.equal(o, full) for o in outs), "batch": _batch_ok(f, xd, full),
                 "bound": bool((err <= bound).all())}
        cases.append(Case("rows", name, backend.name, "fp32", all(flags.values()), err.max().item(),
                          bound.max().item(), _notes(flags)))
        if name == "linear":
            def seen(t: torch.Tensor, f=f) -> torch.Tensor:  # rows that see the batch: one last bit per row count
                y = f(t)
                return y if len(t) == ROWS else torch.nextafter(y, torch.full_like(y, float("inf")))
            cases.append(Case("control: rows see the batch", name, backend.name, "fp32",
                              not _batch_ok(seen, xd, seen(xd)), control=True, note="must fail: batch"))

    x = torch.randn(ROWS, hidden, generator=g) * 3
    w = 1 + 0.2 * torch.randn(hidden, generator=g)
    eps = 1e-6

    def norm(t: torch.Tensor) -> torch.Tensor:
        return backend.rms_norm(t, w.to(dev), eps)

    xd = x.to(dev)
    outs = [norm(xd) for _ in range(repeats)]
    full = outs[0]
    err = (full.cpu().double() - _norm64(x, w, eps)).abs()
    bound = norm_bound(x, w, eps)
    flags = {"repeats": all(torch.equal(o, full) for o in outs), "batch": _batch_ok(norm, xd, full),
             "bound": bool((err <= bound).all())}
    cases.append(Case("rows", "rms norm", backend.name, "fp32", all(flags.values()), err.max().item(),
                      bound.max().item(), _notes(flags)))
    if backend.quant_linear is not None:
        cases += check_quantized(backend, hidden, repeats, seed)
    return cases


def check_q8(backend: Backend, n_out: int, n_in: int, repeats: int, rng, g) -> list[Case]:
    """weights: gguf-q8: each GGUF format with activations rounded to 8 bits: repeats, batch, and the bits of the
    recipe written in torch (tfq.kernels.quant_q8.reference). Its control: the reference on weights with one
    integer changed, where a one-hot input row shows it."""
    from tfq.kernels.quant import FORMATS, from_blocks
    from tfq.kernels.quant_q8 import reference

    cases = []
    for kind in FORMATS:
        weights = from_blocks(kind, random_blocks(kind, n_out, n_in, rng), (n_out, n_in)).with_activations("q8")
        b = torch.randn(n_out, generator=g)
        f = backend.quant_linear(weights, b)
        x = torch.randn(ROWS, n_in, generator=g)
        outs = [f(x) for _ in range(repeats)]
        full = outs[0]
        flags = {"repeats": all(torch.equal(o, full) for o in outs), "batch": _batch_ok(f, x, full),
                 "recipe": torch.equal(full, reference(x, weights, b))}
        cases.append(Case("rows", f"linear {kind}, activations q8", backend.name, "q8", all(flags.values()), 0.0, 0.0,
                          _notes(flags)))
    one_hot = torch.zeros(2, n_in)
    one_hot[0, 5] = 1.0  # row 0's output 3 is d * s (q[3, 5] - zero) * 127 (+ the offset): q[3, 5] shows
    nudged = weights.with_activations("q8")
    nudged.q = weights.q.clone()
    nudged.q[3, 5] ^= 1
    cases.append(Case("control: one integer of the weights changed", f"linear {kind}, activations q8", backend.name,
                      "q8", not torch.equal(backend.quant_linear(weights, None)(one_hot), reference(one_hot, nudged)),
                      control=True, note="must fail: recipe"))
    return cases


def _notes(flags: dict[str, bool]) -> str:
    words = {"repeats": "repeats differ", "batch": "a row's bits change with the batch", "bound": "over the bound",
             "fp32": "bits differ from the fp32 layer on the dequantized weights",
             "recipe": "bits differ from the recipe (tfq.kernels.quant_q8.reference)"}
    return "; ".join(words[k] for k, ok in flags.items() if not ok)
