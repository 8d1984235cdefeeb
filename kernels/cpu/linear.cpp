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
// panel is one contiguous stream (decode reads every weight once a step and is bound by memory). A tile of MR
// rows x 64 outputs keeps 4 * MR accumulators in registers and reads each weight vector once for its MR rows,
// which is what makes long prompts fast. Threads take whole panels. Software prefetches keep memory busy while
// the tiles compute; how the tiles share that work depends on their number (panel_rows).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "checks.h"
#include "lanes.h"
#include "ops.h"
#include "pool.h"
#include "memory.h"
#include "panel.h"

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
constexpr int64_t AHEAD_ROWS = 16;  // rows of the panel (256 bytes each, 4 cache lines) a stream prefetches ahead

// What a tile prefetches while it computes: in its iteration i (0-based) the `lines` cache lines
// base + 64 bytes * ((i * lines + l) * share + first), l = 0 .. lines - 1, into L1 or L2. A tile that streams its
// own rows from memory prefetches AHEAD_ROWS rows ahead of itself (share 1, 4 lines); tiles that compute on
// data already near prefetch what comes next, each taking every share-th line from `first` on.
struct Ahead {
  const char* base;
  int64_t share, first, lines;
  bool to_l2;
};

Ahead own_stream(const float* panel, int64_t k0) {
  return {reinterpret_cast<const char*>(panel + (k0 + AHEAD_ROWS) * PANEL), 1, 0, 4, false};
}

// rows [mr] x the panel's 64 outputs, over inputs [k0, k1): the accumulators start from and return to `acc`
// (in memory between k blocks, so several tiles can share a block of the panel while it is in L1)
template <int mr>
inline void tile(const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, V (*acc)[VECS],
                 Ahead ahead) {
  V a[mr][VECS];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < VECS; j++) a[i][j] = acc[i][j];
  for (int64_t k = k0; k < k1; k++) {
    const float* wk = panel + k * PANEL;
    for (int64_t l = 0, i = k - k0; l < ahead.lines; l++) {
      const char* line = ahead.base + 64 * ((i * ahead.lines + l) * ahead.share + ahead.first);
      if (ahead.to_l2) {
        TFQ_PREFETCH_L2(line);
      } else {
        TFQ_PREFETCH(line);
      }
    }
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

void rows_tile(int64_t rows, const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, V (*acc)[VECS],
               Ahead ahead) {
  switch (rows) {
    case 6: tile<6>(x, K, panel, k0, k1, acc, ahead); break;
    case 5: tile<5>(x, K, panel, k0, k1, acc, ahead); break;
    case 4: tile<4>(x, K, panel, k0, k1, acc, ahead); break;
    case 3: tile<3>(x, K, panel, k0, k1, acc, ahead); break;
    case 2: tile<2>(x, K, panel, k0, k1, acc, ahead); break;
    case 1: tile<1>(x, K, panel, k0, k1, acc, ahead); break;
    default: break;
  }
}

constexpr int64_t KBLOCK = tfq::BLOCK_INPUTS;
constexpr int64_t FEW = tfq::BLOCKED_ROWS;  // up to this many rows (3 to 16 tiles), the tiles go block by block
static_assert(FEW % MR == 0, "the blocks' accumulators hold whole tiles");
// rows of accumulators, plus the bias, into y (from the panel's first output; a row of y is N apart)
void store_rows(const V (*acc)[VECS], int64_t rows, const float* bias, float* y, int64_t N, int64_t outputs) {
  alignas(64) float out[PANEL];
  for (int64_t i = 0; i < rows; i++) {
    for (int j = 0; j < VECS; j++) vstore(out + 16 * j, acc[i][j]);
    for (int64_t n = 0; n < outputs; n++) y[i * N + n] = out[n] + (bias ? bias[n] : 0.f);
  }
}

constexpr int64_t LARGE_PANEL = 512 << 10;  // bytes: a panel this large and the next do not both stay in L2

// A panel's rows in as few tiles as MR allows, their rows balanced (8 rows: 4 + 4); the recipe is the same in
// all of them, so none of this changes a bit. What it changes is how memory and arithmetic overlap (measured
// on the default model's layers by benchmarks/linear_shapes.py, docs/contract.md section 3):
//   1 tile: it streams the panel, prefetching its own rows ahead;
//   2 tiles: the first streams the panel into L2, the second computes from L2 and prefetches the next panel
//     (unless a panel is too large for it and the next to share L2: then as 3-16 tiles);
//   3-16 tiles: blocks of KBLOCK inputs, each read from memory once for every tile while in L1, the tiles
//     splitting the prefetch of the next block between them;
//   more (long prompts, where arithmetic outweighs the stream): tile by tile over the whole panel, in L2.
void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                int64_t outputs) {
  const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, extra = M % tiles;
  alignas(64) V acc[FEW][VECS];
  auto finish = [&](int64_t m, int64_t rows, V (*a)[VECS]) { store_rows(a, rows, bias, y + m * N, N, outputs); };
  auto zero = [&](int64_t rows) {
    for (int64_t i = 0; i < rows; i++)
      for (int j = 0; j < VECS; j++) acc[i][j] = vzero();
  };
  if ((tiles >= 3 || (tiles == 2 && K * PANEL * 4 > LARGE_PANEL)) && M <= FEW) {
    zero(M);
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
      const int64_t k1 = std::min(K, k0 + KBLOCK);
      const char* next = reinterpret_cast<const char*>(panel + k1 * PANEL);  // the next block (or panel)
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; t++) {
        const int64_t rows = base + (t < extra);
        rows_tile(rows, x + m * K, K, panel, k0, k1, acc + m, Ahead{next, tiles, t, (4 + tiles - 1) / tiles, false});
        m += rows;
      }
    }
    finish(0, M, acc);
    return;
  }
  const char* next_panel = reinterpret_cast<const char*>(panel + K * PANEL);
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t rows = base + (t < extra);
    zero(rows);
    const Ahead ahead = tiles == 2 && t == 1 ? Ahead{next_panel, 1, 0, 4, true} : own_stream(panel, 0);
    rows_tile(rows, x + m * K, K, panel, 0, K, acc, ahead);
    finish(m, rows, acc);
    m += rows;
  }
}

// panel_rows' block path with each block written by `fill` into an L1 buffer (panel.h: panel_rows_filled)
void filled_rows(const float* x, int64_t M, int64_t K, tfq::FillBlock fill, const void* from, const float* bias,
                 float* y, int64_t N, int64_t outputs) {
  const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, extra = M % tiles;
  alignas(64) V acc[FEW][VECS];
  alignas(64) float block[KBLOCK * PANEL];
  for (int64_t i = 0; i < M; i++)
    for (int j = 0; j < VECS; j++) acc[i][j] = vzero();
  const Ahead none{nullptr, 1, 0, 0, false};
  for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
    const int64_t k1 = std::min(K, k0 + KBLOCK);
    fill(from, k0, k1, block);
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t rows = base + (t < extra);
      rows_tile(rows, x + m * K + k0, K, block, 0, k1 - k0, acc + m, none);  // x shifted: its column k0 is 0
      m += rows;
    }
  }
  store_rows(acc, M, bias, y, N, outputs);
}

// fp32 panels in weights memory (2 MiB pages where the system allows it: panel.h)
at::Tensor panels_memory(int64_t P, int64_t K, const at::TensorOptions& options) {
  TORCH_CHECK(options.dtype() == at::kFloat, "tfq pack: fp32 panels");
  return tfq::weights_memory(P * K * PANEL * static_cast<int64_t>(sizeof(float))).view(at::kFloat).view({P, K, PANEL});
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
  if (b.has_value()) tfq::checks::vector_of("tfq linear", "the bias", *b, N, "outputs");
  auto y = tfq::pool::empty({M, N}, x.options());
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

at::Tensor tfq::ops::linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& b,
                            int64_t N) {
  return ::linear(x, panels, b, N);
}

namespace tfq {

void panel_rows_fp32(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                     int64_t outputs) {
  panel_rows(x, M, K, panel, bias, y, N, outputs);
}

void panel_rows_filled(const float* x, int64_t M, int64_t K, FillBlock fill, const void* from, const float* bias,
                       float* y, int64_t N, int64_t outputs) {
  TORCH_CHECK(M <= BLOCKED_ROWS, "tfq panel_rows_filled: at most ", BLOCKED_ROWS, " rows");
  filled_rows(x, M, K, fill, from, bias, y, N, outputs);
}
}  // namespace tfq

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor panels, Tensor? b, int n) -> Tensor");
}
// Every op's kernel is registered for CPU tensors only (here and in each file): the dispatcher refuses a tensor on
// another device with an error naming the op, where the kernel would read a GPU or meta pointer and crash.
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("pack", pack);
  m.impl("linear", linear);
}
