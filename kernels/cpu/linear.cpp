// tfq's fp32 linear layer on the CPU: y = x W^T + b, every output element summed in one fixed order.
//
// The order of an element's sum: acc = 0, then acc = fma(x[k], w[k], acc) for k = 0, 1, ..., K - 1 (one
// rounding a step), then acc + bias. Nothing in that recipe depends on how many rows share the call, where a
// row sits among them, which register tile computes it, or how many threads run (threads split the outputs,
// never a sum): a row's bits are the same in any forward (row invariance by construction, which the start-up
// guard still proves on the running build). Lanes run across outputs, so the recipe is the same with AVX-512,
// with AVX2 (two 8-lane halves) and with plain fmaf, and those machines agree bit for bit.
//
// Layout and speed: the weights are packed once into panels of PANEL = 64 outputs, [N / 64][K][64], so that a
// panel is one contiguous stream (decode reads every weight once a step and is bound by memory; a panel is
// prefetched a kilobyte ahead). A tile of MR rows x 64 outputs keeps 4 * MR accumulators in registers and
// reads each weight vector once for its MR rows, which is what makes long prompts fast. Threads take whole
// panels.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "lanes.h"

namespace {

using tfq::V;
using tfq::vbroadcast;
using tfq::vfma;
using tfq::vload;
using tfq::vstore;
using tfq::vzero;

constexpr int64_t PANEL = 64;  // outputs a panel: 4 vectors of 16
constexpr int VECS = PANEL / 16;
constexpr int MR = 6;  // rows a tile: 6 x 4 accumulators + 4 weight vectors + a broadcast fit 32 registers
constexpr int64_t AHEAD = 256;  // floats of the panel prefetched ahead of the ones being read

// rows [mr] x the panel's 64 outputs, over inputs [k0, k1): the accumulators start from and return to `acc`
// (in memory between k blocks, so several tiles can share a block of the panel while it is in L1)
template <int mr>
inline void tile(const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, V (*acc)[VECS]) {
  V a[mr][VECS];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < VECS; j++) a[i][j] = acc[i][j];
  for (int64_t k = k0; k < k1; k++) {
    const float* wk = panel + k * PANEL;
    TFQ_PREFETCH(wk + AHEAD);
    TFQ_PREFETCH(wk + AHEAD + 32);
    V w[VECS];
    for (int j = 0; j < VECS; j++) w[j] = vload(wk + 16 * j);
    for (int i = 0; i < mr; i++) {
      const V xb = vbroadcast(x[i * K + k]);
      for (int j = 0; j < VECS; j++) a[i][j] = vfma(xb, w[j], a[i][j]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < VECS; j++) acc[i][j] = a[i][j];
}

void rows_tile(int64_t rows, const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, V (*acc)[VECS]) {
  switch (rows) {
    case 6: tile<6>(x, K, panel, k0, k1, acc); break;
    case 5: tile<5>(x, K, panel, k0, k1, acc); break;
    case 4: tile<4>(x, K, panel, k0, k1, acc); break;
    case 3: tile<3>(x, K, panel, k0, k1, acc); break;
    case 2: tile<2>(x, K, panel, k0, k1, acc); break;
    case 1: tile<1>(x, K, panel, k0, k1, acc); break;
    default: break;
  }
}

constexpr int64_t KBLOCK = 64;  // inputs of a panel block that the tiles of a few rows share while it is in L1
constexpr int64_t FEW = 4 * MR;  // up to this many rows, the tiles go block by block (decode, verifies)

void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                int64_t outputs) {
  // as few tiles as MR allows, their rows balanced (8 rows: 4 + 4); the recipe is the same in all of them
  const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, extra = M % tiles;
  alignas(64) V acc[FEW][VECS];
  auto finish = [&](int64_t m, int64_t rows, V (*a)[VECS]) {
    alignas(64) float out[PANEL];
    for (int64_t i = 0; i < rows; i++) {
      for (int j = 0; j < VECS; j++) vstore(out + 16 * j, a[i][j]);
      for (int64_t n = 0; n < outputs; n++) y[(m + i) * N + n] = out[n] + (bias ? bias[n] : 0.f);
    }
  };
  if (M <= FEW) {  // few rows: each block of the panel is read from memory once, for every tile
    for (int64_t i = 0; i < M; i++)
      for (int j = 0; j < VECS; j++) acc[i][j] = vzero();
    const int64_t step = tiles > 1 ? KBLOCK : K;
    for (int64_t k0 = 0; k0 < K; k0 += step) {
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; t++) {
        const int64_t rows = base + (t < extra);
        rows_tile(rows, x + m * K, K, panel, k0, std::min(K, k0 + step), acc + m);
        m += rows;
      }
    }
    finish(0, M, acc);
    return;
  }
  int64_t m = 0;  // many rows: tile by tile over the whole panel (it stays in L2)
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t rows = base + (t < extra);
    for (int64_t i = 0; i < rows; i++)
      for (int j = 0; j < VECS; j++) acc[i][j] = vzero();
    rows_tile(rows, x + m * K, K, panel, 0, K, acc);
    finish(m, rows, acc);
    m += rows;
  }
}

// Panels in 2 MiB pages where the system allows it (Linux's transparent huge pages, asked for with madvise):
// a decode step streams every weight once, and with 4 KiB pages it walks the page tables every 4 KiB; measured
// here, huge pages make the stream 7-10% faster. The start is 2 MiB-aligned and only whole 2 MiB pages are
// asked for, so the tail of a matrix costs no more memory than it uses.
at::Tensor panels_memory(int64_t P, int64_t K, const at::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t HUGE = size_t(2) << 20;
  const size_t bytes = static_cast<size_t>(P * K * PANEL) * sizeof(float);
  void* mem = nullptr;
  if (bytes >= HUGE && posix_memalign(&mem, HUGE, bytes) == 0) {
    madvise(mem, bytes / HUGE * HUGE, MADV_HUGEPAGE);  // advice only: without it the pages are small, same bits
    return at::from_blob(mem, {P, K, PANEL}, [](void* p) { std::free(p); }, options);
  }
#endif
  return at::empty({P, K, PANEL}, options);
}

// w [N, K] -> panels [ceil(N / 64)][K][64], outputs past N zero
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "tfq pack: w [N, K] fp32");
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL;
  auto out = panels_memory(P, K, w.options());
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
      for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < PANEL; j++) {
          const int64_t n = p * PANEL + j;
          op[(p * K + k) * PANEL + j] = n < N ? wp[n * K + k] : 0.f;
        }
  });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& b, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && x.size(1) == panels.size(1) && panels.size(2) == PANEL,
              "tfq linear: x [M, K], panels [P, K, 64]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "tfq linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous(), "tfq linear: contiguous operands only");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(N <= P * PANEL && N > (P - 1) * PANEL, "tfq linear: N does not match the panels");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
      panel_rows(xp, M, K, wp + p * K * PANEL, bp ? bp + p * PANEL : nullptr, yp + p * PANEL, N,
                 std::min(PANEL, N - p * PANEL));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("pack(Tensor w) -> Tensor", pack);
  m.def("linear(Tensor x, Tensor panels, Tensor? b, int n) -> Tensor", linear);
}
