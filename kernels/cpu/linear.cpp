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
#include <cmath>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TFQ_PREFETCH(p) _mm_prefetch((const char*)(p), _MM_HINT_T0)
#else
#define TFQ_PREFETCH(p) __builtin_prefetch(p)
#endif

namespace {

#if defined(__AVX512F__)
struct V { __m512 a; };
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vfma(V x, V w, V acc) { return {_mm512_fmadd_ps(x.a, w.a, acc.a)}; }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v.a); }
#elif defined(__AVX2__) && defined(__FMA__)
struct V { __m256 lo, hi; };
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vfma(V x, V w, V acc) { return {_mm256_fmadd_ps(x.lo, w.lo, acc.lo), _mm256_fmadd_ps(x.hi, w.hi, acc.hi)}; }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
#else
struct V { float f[16]; };
inline V vzero() { V v; for (int i = 0; i < 16; i++) v.f[i] = 0.f; return v; }
inline V vload(const float* p) { V v; for (int i = 0; i < 16; i++) v.f[i] = p[i]; return v; }
inline V vfma(V x, V w, V acc) { V v; for (int i = 0; i < 16; i++) v.f[i] = std::fma(x.f[i], w.f[i], acc.f[i]); return v; }
inline void vstore(float* p, V v) { for (int i = 0; i < 16; i++) p[i] = v.f[i]; }
#endif

constexpr int LANES = 16;
constexpr int MR = 4;   // rows a tile
constexpr int NR = 6;   // outputs a tile: MR * NR accumulators + NR weight vectors fit AVX-512's 32 registers
constexpr int PANEL = 8 * NR;  // outputs whose weights stay in cache while the rows of a block pass over them
constexpr int64_t AHEAD = 256;  // floats of a weight row prefetched ahead of the one being read

inline float reduce(V v) {
  alignas(64) float f[LANES];
  vstore(f, v);
  for (int i = 0; i < 8; i++) f[i] = f[i] + f[i + 8];
  for (int i = 0; i < 4; i++) f[i] = f[i] + f[i + 4];
  for (int i = 0; i < 2; i++) f[i] = f[i] + f[i + 2];
  return f[0] + f[1];
}

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

TORCH_LIBRARY(tfq_cpu, m) { m.def("linear(Tensor x, Tensor w, Tensor? b) -> Tensor", linear); }
