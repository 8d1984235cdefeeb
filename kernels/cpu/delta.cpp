// A Qwen3.5 hybrid's own ops on the CPU: the Gated DeltaNet token mixer (causal convolution, then the gated
// delta rule's recurrence), its gated RMS norm, and the sigmoid gate of its full attention layers.
//
// The recurrence runs row by row for every row, prompt or decode: one arithmetic per position, whatever the
// prefill chunking or the batch (docs/hybrid.md says why not the chunked algorithm). Every number is computed
// by one thread in one fixed order from its own stream's inputs, so a row's bits never depend on the rows beside
// it or on the thread count; the ops are lane-wise IEEE operations (fma1 in the scalar tails), so AVX-512,
// AVX2 and plain C++ give the same bits.
//
// For one stream's segment of rows, with its state slot (fresh: start from zeros):
//   convolution, channel c:  y = w[0] x[t-K+1] (then fma(x[t-K+1+j], w[j], y) for j = 1..K-1), out = silu(y)
//   per key head:            q = (q * r_q) * 1/sqrt(dk), k = k * r_k, r = 1 / sqrt(sum of squares + 1e-6)
//   per value head h:        beta = 1 / (1 + exp(-b)), decay = exp(A * softplus(a + dt_bias)), A = -exp(A_log)
//   given as it is (computed once at load by torch, as transformers computes it, or as a GGUF file stores it)
//                            S = S * decay; kv = sum_i S[i] k[i]; delta = (v - kv) * beta;
//                            S[i] = fma(k[i], delta, S[i]); o = sum_i S[i] q[i]   (sums: i in order, fma)
// With `save`, a segment's state as it was before its first row (the convolution window and the recurrence) is
// copied aside too, so a draft verify's rejected rows can be rolled back: the state is restored and the rows
// kept are run again from their inputs, in this same arithmetic (tfq/model/qwen.py, `roll_back`).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "checks.h"
#include "lanes.h"
#include "pool.h"

namespace {

using tfq::V;

// y = y * s over n floats
inline void scale_row(float* y, float s, int64_t n) {
  const V sv = tfq::vbroadcast(s);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) tfq::vstore(y + j, tfq::vmul(tfq::vload(y + j), sv));
  for (; j < n; j++) y[j] = y[j] * s;
}

// acc = fma(x, s, acc) over n floats
inline void fma_row(float* acc, const float* x, float s, int64_t n) {
  const V sv = tfq::vbroadcast(s);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) tfq::vstore(acc + j, tfq::vfma(tfq::vload(x + j), sv, tfq::vload(acc + j)));
  for (; j < n; j++) acc[j] = tfq::fma1(x[j], s, acc[j]);
}

// The sum of squares of n floats in rms_norm_row's order: 16 lanes of fmas, then the fixed tree.
inline float sum_squares(const float* x, int64_t n) {
  V acc = tfq::vzero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const V v = tfq::vload(x + i);
    acc = tfq::vfma(v, v, acc);
  }
  alignas(64) float lanes[16];
  tfq::vstore(lanes, acc);
  for (int64_t l = 0; i < n; i++, l++) lanes[l] = tfq::fma1(x[i], x[i], lanes[l]);
  return tfq::reduce(tfq::vload(lanes));
}

// exp of one float, as tfq's vector exp computes it on every instruction set
inline float exp1(float x) { return tfq::exp1(x); }

// log(1 + exp(x)), as torch's softplus (beta 1, threshold 20): x itself above the threshold; exp and log1p by
// lanes.h's recipes (not libm's, whose last bit follows the C library and the CPU)
inline float softplus(float x) { return x > 20.0f ? x : tfq::log1p1(exp1(x)); }

struct Dims {
  int64_t rows, channels, kernel, key_heads, key_dim, value_heads, value_dim;
  bool saves;
};

// The causal convolution of one segment over 16 channels from c0: SiLU of the K taps, the window kept.
void convolve(const float* x, const float* w, float* window, float* save, float* out, int64_t row0, int64_t count,
              bool fresh, int64_t c0, const Dims& d) {
  const int64_t C = d.channels, K = d.kernel, cnt = std::min<int64_t>(16, C - c0);
  alignas(64) float hist[16][16] = {};  // the window: rows t-K+1 .. t-1, 16 channels each (1 <= K <= 16: deltanet)
  if (!fresh)
    for (int64_t j = 0; j < K - 1; j++) std::memcpy(hist[j], window + j * C + c0, cnt * sizeof(float));
  if (save != nullptr)
    for (int64_t j = 0; j < K - 1; j++) std::memcpy(save + j * C + c0, hist[j], cnt * sizeof(float));
  alignas(64) float taps[16][16] = {};
  for (int64_t j = 0; j < K; j++) std::memcpy(taps[j], w + j * C + c0, cnt * sizeof(float));
  for (int64_t r = 0; r < count; r++) {
    alignas(64) float in[16] = {}, y[16];
    std::memcpy(in, x + (row0 + r) * C + c0, cnt * sizeof(float));
    const V now = tfq::vload(in);
    V acc = tfq::vmul(K > 1 ? tfq::vload(hist[0]) : now, tfq::vload(taps[0]));
    for (int64_t j = 1; j < K; j++) acc = tfq::vfma(j < K - 1 ? tfq::vload(hist[j]) : now, tfq::vload(taps[j]), acc);
    tfq::vstore(y, tfq::vsilu(acc));
    std::memcpy(out + (row0 + r) * C + c0, y, cnt * sizeof(float));
    if (K > 1) {
      for (int64_t j = 0; j + 1 < K - 1; j++) std::memcpy(hist[j], hist[j + 1], sizeof(hist[j]));
      std::memcpy(hist[K - 2], in, sizeof(in));
    }
  }
  for (int64_t j = 0; j < K - 1; j++) std::memcpy(window + j * C + c0, hist[j], cnt * sizeof(float));
}

// Queries and keys L2-normed (queries scaled by 1/sqrt(dk)), and each value head's beta and decay, for one row.
void prepare_row(const float* conv, const float* a, const float* b, const float* A, const float* dt_bias,
                 float* q, float* k, float* beta, float* decay, int64_t t, const Dims& d) {
  const int64_t kd = d.key_dim, qk = d.key_heads * kd;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kd)));
  const float* row = conv + t * d.channels;
  for (int64_t hk = 0; hk < d.key_heads; hk++) {
    const float* qs = row + hk * kd;
    const float* ks = row + qk + hk * kd;
    const float rq = 1.0f / std::sqrt(sum_squares(qs, kd) + 1e-6f);
    const float rk = 1.0f / std::sqrt(sum_squares(ks, kd) + 1e-6f);
    for (int64_t i = 0; i < kd; i++) {
      q[t * qk + hk * kd + i] = (qs[i] * rq) * scale;
      k[t * qk + hk * kd + i] = ks[i] * rk;
    }
  }
  for (int64_t h = 0; h < d.value_heads; h++) {
    const int64_t e = t * d.value_heads + h;
    beta[e] = 1.0f / (1.0f + exp1(-b[e]));
    decay[e] = exp1(A[h] * softplus(a[e] + dt_bias[h]));
  }
}

// The gated delta rule for one segment and one value head, row by row; S is the head's state [dk][dv].
void recur(const float* conv, const float* q, const float* k, const float* beta, const float* decay, float* S,
           float* save, float* out, int64_t row0, int64_t count, bool fresh, int64_t h, const Dims& d) {
  const int64_t kd = d.key_dim, vd = d.value_dim, qk = d.key_heads * kd;
  const int64_t hk = h / (d.value_heads / d.key_heads);  // each key head serves consecutive value heads
  if (fresh) std::memset(S, 0, kd * vd * sizeof(float));
  if (save != nullptr) std::memcpy(save, S, kd * vd * sizeof(float));
  float kv[1024], delta[1024];  // vd <= 1024: checked by deltanet
  for (int64_t r = 0; r < count; r++) {
    const int64_t t = row0 + r, e = t * d.value_heads + h;
    const float* qt = q + t * qk + hk * kd;
    const float* kt = k + t * qk + hk * kd;
    const float* vt = conv + t * d.channels + 2 * qk + h * vd;
    std::fill(kv, kv + vd, 0.0f);
    for (int64_t i = 0; i < kd; i++) {
      scale_row(S + i * vd, decay[e], vd);
      fma_row(kv, S + i * vd, kt[i], vd);
    }
    for (int64_t j = 0; j < vd; j++) delta[j] = (vt[j] - kv[j]) * beta[e];
    float* o = out + t * d.value_heads * vd + h * vd;
    std::fill(o, o + vd, 0.0f);
    for (int64_t i = 0; i < kd; i++) {
      fma_row(S + i * vd, delta, kt[i], vd);
      fma_row(o, S + i * vd, qt[i], vd);
    }
  }
}

// x [N, C] (in_proj_qkv's rows), a and b [N, Hv], conv_w [K, C], A and dt_bias [Hv]; the states of every
// slot: conv_state [slots, K-1, C], rec_state [slots, Hv, dk, dv], updated in place; segments [S, 5] int64:
// first row, rows, slot, fresh, save. save_conv and save_rec (shaped as the states, or empty) take the state of a
// segment with save as it was before its first row. Returns o [N, Hv * dv].
at::Tensor deltanet(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& conv_w,
                    const at::Tensor& A, const at::Tensor& dt_bias, at::Tensor conv_state, at::Tensor rec_state,
                    const at::Tensor& segments, at::Tensor save_conv, at::Tensor save_rec, int64_t key_heads,
                    int64_t key_dim, int64_t value_heads, int64_t value_dim) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &a, &b, &conv_w, &A, &dt_bias, &conv_state, &rec_state, &save_conv, &save_rec})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "tfq deltanet: fp32, contiguous tensors");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.is_contiguous() && segments.dim() == 2 &&
              segments.size(1) == 5, "tfq deltanet: segments [S, 5] int64");
  TORCH_CHECK(key_heads > 0 && key_dim > 0 && value_heads > 0 && value_dim > 0 && value_heads % key_heads == 0,
              "tfq deltanet: value heads a multiple of key heads");
  TORCH_CHECK(value_dim <= 1024, "tfq deltanet: value heads wider than 1024");
  TORCH_CHECK(x.dim() == 2 && conv_w.dim() == 2, "tfq deltanet: x [N, C], conv_w [K, C]");
  const Dims d{x.size(0), x.size(1), conv_w.size(0), key_heads, key_dim, value_heads, value_dim,
               save_rec.numel() > 0};
  TORCH_CHECK(d.channels == 2 * key_heads * key_dim + value_heads * value_dim, "tfq deltanet: channels");
  TORCH_CHECK(d.kernel >= 1 && d.kernel <= 16 && conv_w.size(1) == d.channels, "tfq deltanet: conv_w ", conv_w.sizes(),
              ", not [K, ", d.channels, "] with 1 to 16 taps");
  TORCH_CHECK(a.dim() == 2 && a.size(0) == d.rows && a.size(1) == value_heads && b.sizes() == a.sizes(),
              "tfq deltanet: a ", a.sizes(), " and b ", b.sizes(), ", not [", d.rows, ", ", value_heads, "]");
  tfq::checks::vector_of("tfq deltanet", "A", A, value_heads, "value heads");
  tfq::checks::vector_of("tfq deltanet", "dt_bias", dt_bias, value_heads, "value heads");
  // the states: a slot each, the window of K - 1 rows of the channels, and Hv states [dk][dv]
  const int64_t slots = conv_state.dim() == 3 ? conv_state.size(0) : -1;
  TORCH_CHECK(slots >= 0 && conv_state.size(1) == d.kernel - 1 && conv_state.size(2) == d.channels &&
              rec_state.sizes() == at::IntArrayRef({slots, value_heads, key_dim, value_dim}),
              "tfq deltanet: conv_state ", conv_state.sizes(), " and rec_state ", rec_state.sizes(), ", not [slots, ",
              d.kernel - 1, ", ", d.channels, "] and [slots, ", value_heads, ", ", key_dim, ", ", value_dim, "]");
  const int64_t S = segments.size(0), blocks = (d.channels + 15) / 16, qk = key_heads * key_dim;
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; s++) {  // a segment's rows of x, and the slot whose state it reads and writes
    const int64_t first = seg[s * 5], count = seg[s * 5 + 1], slot = seg[s * 5 + 2];
    TORCH_CHECK(first >= 0 && count >= 0 && first <= d.rows - count, "tfq deltanet: segment ", s, "'s rows ", first,
                " .. ", first + count, " are outside the ", d.rows, " rows");
    TORCH_CHECK(slot >= 0 && slot < slots, "tfq deltanet: segment ", s, "'s slot ", slot, " is outside the ", slots,
                " slots");
    TORCH_CHECK(!seg[s * 5 + 4] || d.saves, "tfq deltanet: a segment to save, and nowhere to save it");
  }
  TORCH_CHECK(!d.saves || (save_conv.sizes() == conv_state.sizes() && save_rec.sizes() == rec_state.sizes()),
              "tfq deltanet: save_conv and save_rec shaped as the states");
  auto conv = tfq::pool::empty_like(x);
  auto q = tfq::pool::empty({d.rows, qk}, x.options()), k = tfq::pool::empty({d.rows, qk}, x.options());
  auto beta = tfq::pool::empty({d.rows, value_heads}, x.options());
  auto decay = tfq::pool::empty({d.rows, value_heads}, x.options());
  auto out = tfq::pool::empty({d.rows, value_heads * value_dim}, x.options());
  const int64_t window = (d.kernel - 1) * d.channels, state = value_heads * key_dim * value_dim;
  float* cs = conv_state.data_ptr<float>();
  float* rs = rec_state.data_ptr<float>();
  float* sc = d.saves ? save_conv.data_ptr<float>() : nullptr;
  float* sr = d.saves ? save_rec.data_ptr<float>() : nullptr;
  at::parallel_for(0, S * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t* g = seg + (i / blocks) * 5;
      float* save = g[4] ? sc + g[2] * window : nullptr;
      convolve(x.data_ptr<float>(), conv_w.data_ptr<float>(), cs + g[2] * window, save, conv.data_ptr<float>(),
               g[0], g[1], g[3] != 0, (i % blocks) * 16, d);
    }
  });
  at::parallel_for(0, d.rows, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      prepare_row(conv.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), A.data_ptr<float>(),
                  dt_bias.data_ptr<float>(), q.data_ptr<float>(), k.data_ptr<float>(), beta.data_ptr<float>(),
                  decay.data_ptr<float>(), t, d);
  });
  at::parallel_for(0, S * value_heads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t* g = seg + (i / value_heads) * 5;
      const int64_t h = i % value_heads;
      const int64_t head = h * key_dim * value_dim;
      float* save = g[4] ? sr + g[2] * state + head : nullptr;
      recur(conv.data_ptr<float>(), q.data_ptr<float>(), k.data_ptr<float>(), beta.data_ptr<float>(),
            decay.data_ptr<float>(), rs + g[2] * state + head, save, out.data_ptr<float>(), g[0],
            g[1], g[3] != 0, h, d);
    }
  });
  return out;
}

// The DeltaNet output's norm, gated: per row of n, y = ((x * r) * w) * silu(z), r as in rms_norm_row.
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& z, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && z.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
              x.is_contiguous() && z.is_contiguous() && w.is_contiguous() && x.sizes() == z.sizes() &&
              x.size(-1) == w.size(0), "tfq gated_rms_norm: x and z [..., n], w [n], fp32");
  auto y = tfq::pool::empty_like(x);
  const int64_t n = w.size(0), rows = n ? x.numel() / n : 0;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    alignas(64) float in[16], g[16];
    for (int64_t r = r0; r < r1; r++) {
      float* yr = y.data_ptr<float>() + r * n;
      const float* zr = z.data_ptr<float>() + r * n;
      tfq::rms_norm_row(x.data_ptr<float>() + r * n, w.data_ptr<float>(), n, e, yr);
      for (int64_t j = 0; j < n; j += 16) {
        const int64_t cnt = std::min<int64_t>(16, n - j);
        std::fill(in, in + 16, 0.0f);
        std::memcpy(in, zr + j, cnt * sizeof(float));
        tfq::vstore(g, tfq::vsilu(tfq::vload(in)));
        for (int64_t l = 0; l < cnt; l++) yr[j + l] = yr[j + l] * g[l];
      }
    }
  });
  return y;
}

// Gated attention's output: x * sigmoid(g), sigmoid(g) = 1 / (1 + exp(-g)), element by element.
at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& g) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat && x.is_contiguous() &&
              g.is_contiguous() && x.sizes() == g.sizes(), "tfq sigmoid_gate: x and g alike, fp32");
  auto y = tfq::pool::empty_like(x);
  const int64_t n = x.numel();
  at::parallel_for(0, (n + 15) / 16, 256, [&](int64_t b0, int64_t b1) {
    alignas(64) float in[16], s[16];
    for (int64_t blk = b0; blk < b1; blk++) {
      const int64_t i0 = blk * 16, cnt = std::min<int64_t>(16, n - i0);
      std::fill(in, in + 16, 0.0f);
      std::memcpy(in, g.data_ptr<float>() + i0, cnt * sizeof(float));
      const V one = tfq::vbroadcast(1.0f);
      tfq::vstore(s, tfq::vdiv(one, tfq::vadd(one, tfq::vexp(tfq::vsub(tfq::vzero(), tfq::vload(in))))));
      const float* xs = x.data_ptr<float>() + i0;
      float* ys = y.data_ptr<float>() + i0;
      for (int64_t l = 0; l < cnt; l++) ys[l] = xs[l] * s[l];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("deltanet(Tensor x, Tensor a, Tensor b, Tensor conv_w, Tensor A, Tensor dt_bias, Tensor(a!) conv_state, "
        "Tensor(b!) rec_state, Tensor segments, Tensor(c!) save_conv, Tensor(d!) save_rec, int key_heads, "
        "int key_dim, int value_heads, int value_dim) -> Tensor");
  m.def("gated_rms_norm(Tensor x, Tensor w, Tensor z, float eps) -> Tensor");
  m.def("sigmoid_gate(Tensor x, Tensor g) -> Tensor");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("deltanet", deltanet);
  m.impl("gated_rms_norm", gated_rms_norm);
  m.impl("sigmoid_gate", sigmoid_gate);
}
