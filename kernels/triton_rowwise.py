"""The model's per-row layers in Triton (the GPU path; the CPU runs them under TRITON_INTERPRET=1): linear
and RMS norm, each giving a row the same bits whatever other rows share the call.

Why they are batch-invariant: one launch configuration for every batch size (no autotuning, no split-K),
so an output element is always the sum over the same K tiles in the same order, and the fp32 dot runs with
input_precision="ieee" (no TF32), a chain of multiply-adds per element that other rows do not enter. Rows
past the batch are masked loads of zero and never stored. The norm is one program per row with a fixed
block. cuBLAS gives no such promise (it picks kernels, split-K included, by the batch size); that is why
the GPU path does not use it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Every multiply and add rounds on its own, as in kernels/triton_attention.py.
LAUNCH = dict(enable_fp_fusion=False)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(kk < K)[:, None] & (rn < N)[None, :],
                    other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


# Tiles, fixed for every batch size: the heart of the invariance. On a GPU the ieee dot is one multiply-add
# chain per output element, the same at any place in the block, and tl.dot needs 16 rows. The interpreter's
# dot is numpy's matmul, whose bits for a row change with its place in the block (measured): there each row
# gets its own program, and wider tiles, since it pays per program and operation, not per element.
INTERPRETED = type(_linear_kernel).__name__ == "InterpretedFunction"
BLOCK_M, BLOCK_N, BLOCK_K = (1, 128, 128) if INTERPRETED else (16, 32, 32)


class TritonLinear:
    """y = x W^T + b in fp32; W stays [out, in] on the device."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, device: torch.device | None = None,
                 block_m: int | None = None):
        self.out_features, self.in_features = weight.shape
        self.block_m = block_m or BLOCK_M
        self.weight = weight.detach().float().to(device).contiguous()
        self.bias = None if bias is None else bias.detach().float().to(device).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(f"linear needs fp32 rows of {self.in_features}, got {x.dtype} {tuple(x.shape)}")
        x = x if x.stride(-1) == 1 else x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, device=x.device)
        if m == 0:
            return y
        grid = (triton.cdiv(m, self.block_m), triton.cdiv(self.out_features, BLOCK_N))
        bias = self.bias if self.bias is not None else self.weight  # never read without HAS_BIAS
        _linear_kernel[grid](x, self.weight, bias, y, m, self.out_features, self.in_features, x.stride(0),
                             self.weight.stride(0), y.stride(0), HAS_BIAS=self.bias is not None, BM=self.block_m,
                             BN=BLOCK_N, BK=BLOCK_K, **LAUNCH)
        return y


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    live = d < n
    x = tl.load(x_ptr + row * stride_x + d, mask=live, other=0.0)
    mean = tl.sum(x * x, 0) / n
    y = x * (1.0 / tl.sqrt_rn(mean + eps)) * tl.load(w_ptr + d, mask=live, other=0.0)
    tl.store(y_ptr + row * stride_y + d, y, mask=live)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dimension; x [..., n] fp32, one program per row."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    y = torch.empty(rows.shape, device=x.device)
    if len(rows):
        _rms_norm_kernel[(len(rows),)](rows, weight, y, n, rows.stride(0), y.stride(0), eps,
                                       BLOCK=triton.next_power_of_2(n), **LAUNCH)
    return y.view(x.shape)
