// tfq's fp32 linear layer on the CPU: y = x W^T + b, every output element summed in one fixed order.
//
// The order of an element's sum: 16 lanes, lane l taking k = 16 j + l for j = 0, 1, ... by fused
// multiply-add, then the lanes added in a fixed tree ((l, l + 8), (l, l + 4), (l, l + 2), (0, 1)), then the
// bias. Nothing in that recipe depends on how many rows share the call, where a row sits among them, which
// tile of the loop computes it, or how many threads run: a row's bits are the same in any forward (row
// invariance by construction, which the start-up guard still proves on the running build). The recipe is the
// same with AVX-512, with AVX2 (two 8-lane halves) and without either (fmaf per lane), so those machines
// agree bit for bit too.
//
// Speed: a tile of MR rows x NR outputs keeps MR * NR accumulators in registers and reads each weight vector
// once for all MR rows; weight rows are prefetched a kilobyte ahead, since decode streams every weight once
// a step and is bound by memory. Threads split the outputs (at::parallel_for, torch's own pool).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "lanes.h"

namespace {

using tfq::V;
using tfq::reduce;
using tfq::vfma;
using tfq::vload;
using tfq::vzero;

constexpr int LANES = 16;
constexpr int MR = 4;   // rows a tile
constexpr int NR = 6;   // outputs a tile: MR * NR accumulators + NR weight vectors fit AVX-512's 32 registers
constexpr int PANEL = 8 * NR;  // outputs whose weights stay in cache while the rows of a block pass over them
constexpr int64_t AHEAD = 256;  // floats of a weight row prefetched ahead of the one being read

template <int mr, int nr>
inline void tile(const float* x, const float* w, int64_t K, const float* bias, float* y, int64_t N) {
  V acc[mr][nr];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = vzero();
  for (int64_t k = 0; k < K; k += LANES) {
    V wv[nr];
    for (int j = 0; j < nr; j++) {
      TFQ_PREFETCH(w + j * K + k + AHEAD);
      wv[j] = vload(w + j * K + k);
    }
    for (int i = 0; i < mr; i++) {
      V xv = vload(x + i * K + k);
      for (int j = 0; j < nr; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) y[i * N + j] = reduce(acc[i][j]) + (bias ? bias[j] : 0.f);
}

template <int mr>
void rows_by_panel(const float* x, const float* w, int64_t K, const float* bias, float* y, int64_t N, int64_t n0,
                   int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<mr, NR>(x, w + n * K, K, bias ? bias + n : nullptr, y + n, N);
  for (; n < n1; n++) tile<mr, 1>(x, w + n * K, K, bias ? bias + n : nullptr, y + n, N);
}

void outputs(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y, int64_t N,
             int64_t n0, int64_t n1) {
  // blocks of rows small enough to stay in L2 while each panel of weights streams past them once
  const int64_t block = std::max<int64_t>(MR, (int64_t(1) << 20) / (K * 4) / MR * MR);
  for (int64_t mb = 0; mb < M; mb += block) {
    const int64_t me = std::min(M, mb + block);
    for (int64_t p = n0; p < n1; p += PANEL) {
      const int64_t pe = std::min(n1, p + PANEL);
      int64_t m = mb;
      for (; m + MR <= me; m += MR) rows_by_panel<MR>(x + m * K, w, K, bias, y + m * N, N, p, pe);
      switch (me - m) {
        case 3: rows_by_panel<3>(x + m * K, w, K, bias, y + m * N, N, p, pe); break;
        case 2: rows_by_panel<2>(x + m * K, w, K, bias, y + m * N, N, p, pe); break;
        case 1: rows_by_panel<1>(x + m * K, w, K, bias, y + m * N, N, p, pe); break;
        default: break;
      }
    }
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "tfq linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "tfq linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "tfq linear: contiguous operands only");
  TORCH_CHECK(x.size(1) % LANES == 0, "tfq linear: K must be a multiple of 16 (pad it with zeros)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + NR - 1) / NR;
  // a few chunks a thread, so a slow core does not hold the rest up; whole tiles of outputs a chunk
  const int64_t grain = std::max<int64_t>(PANEL / NR, tiles / (4 * at::get_num_threads()));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    outputs(xp, M, K, wp, bp, yp, N, t0 * NR, std::min(N, t1 * NR));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) { m.def("linear(Tensor x, Tensor w, Tensor? b) -> Tensor", linear); }
