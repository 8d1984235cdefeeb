// What linear.cpp lends the other kernels: its fixed-order recipe over one panel of 64 outputs, so a layer whose
// weights are stored another way (quant.cpp) unpacks a panel to fp32 and then sums exactly as linear.cpp does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tfq {

constexpr int64_t PANEL_OUTPUTS = 64;
constexpr int64_t BLOCK_INPUTS = 64;  // inputs of a panel block that the tiles share while it is in L1
constexpr int64_t BLOCKED_ROWS = 96;  // up to this many rows, the tiles go through a panel block by block

// y[m][n] for rows m < M and the panel's `outputs` columns (y and bias start at the panel's first output; a row
// of y is N apart): acc = 0, acc = fma(x[m][k], panel[k][n], acc) for k = 0 .. K - 1, then acc + bias[n]
void panel_rows_fp32(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                     int64_t outputs);

// The same, for up to BLOCKED_ROWS rows of a panel kept another way: fill(from, k0, k1, block) writes the panel's
// fp32 weights for inputs [k0, k1) into block [k1 - k0][64] (k1 - k0 <= BLOCK_INPUTS), and every row's tile runs
// over that block while it is in L1, so reading the next block's bytes overlaps the arithmetic on this one.
using FillBlock = void (*)(const void* from, int64_t k0, int64_t k1, float* block);
void panel_rows_filled(const float* x, int64_t M, int64_t K, FillBlock fill, const void* from, const float* bias,
                       float* y, int64_t N, int64_t outputs);

}  // namespace tfq
