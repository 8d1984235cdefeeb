// What linear.cpp lends the other kernels: its fixed-order recipe over one panel of 64 outputs, so a layer whose
// weights are stored another way (quant.cpp) unpacks a panel to fp32 and then sums exactly as linear.cpp does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tfq {

constexpr int64_t PANEL_OUTPUTS = 64;

// y[m][n] for rows m < M and the panel's `outputs` columns (y and bias start at the panel's first output; a row
// of y is N apart): acc = 0, acc = fma(x[m][k], panel[k][n], acc) for k = 0 .. K - 1, then acc + bias[n]
// `bytes` of memory for weights, in 2 MiB pages where the system allows it (Linux's transparent huge pages,
// asked for with madvise): a decode step streams every weight once, and with 4 KiB pages it walks the page
// tables every 4 KiB; measured here, huge pages make the stream 7-10% faster. The start is 2 MiB-aligned and
// only whole 2 MiB pages are asked for, so a tail costs no more memory than it uses.
at::Tensor weights_memory(int64_t bytes);

void panel_rows_fp32(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                     int64_t outputs);

}  // namespace tfq
