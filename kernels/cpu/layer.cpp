// One decoder layer of a Qwen model in one call: the same ops, in the same order, on the same tensors as the
// layer written op by op in Python (tfq/model/qwen.py, Qwen.decoder_layer), so the same bits by construction;
// the start-up guard still checks, on the running build, that both give every row the same bits.
//
// Why it exists: a decode step at one lane spends far longer between its linear layers than their small ops
// need. Each of the ~25 ops of a layer, dispatched from Python, runs its interpreter and dispatcher code cold,
// after a linear layer has streamed tens of megabytes through the caches. Here a layer is one dispatch.
//
// The kernels are tfq's own ops (linear, rms_norm, attend), called through torch's dispatcher; the elementwise
// steps are written here with the same roundings as the ops Python calls: rotary and the store into an fp32
// cache in one pass (a narrow cache keeps torch's clamp and cast), the attention residual with the post norm,
// SiLU (lanes.h, as tfq's silu) times up. Each is a row's own work, so it is row-invariant by construction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <tuple>

#include "lanes.h"

namespace {

using OptTensor = c10::optional<at::Tensor>;

// fp32 panels (linear.cpp) or a quantized blob (quant.cpp, uint8): the same recipe either way
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const OptTensor& bias, int64_t n) {
  using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t);
  static auto fp32 = c10::Dispatcher::singleton().findSchemaOrThrow("tfq_cpu::linear", "").typed<Linear>();
  static auto quant = c10::Dispatcher::singleton().findSchemaOrThrow("tfq_cpu::qlinear", "").typed<Linear>();
  return (panels.scalar_type() == at::kByte ? quant : fp32).call(x.contiguous(), panels, bias, n);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x.contiguous(), w, eps);
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                  const at::Tensor& offsets, const at::Tensor& lengths, double scale, int64_t tile, int64_t split) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::attend", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, double, int64_t, int64_t)>();
  return op.call(q.contiguous(), kc, vc, table, offsets, lengths, scale, tile, split);
}

// Rotary on queries and keys, x_i * cos_i + x_{(i + D/2) mod D} * sin_i (two products and a sum, each rounded
// once: torch's x * cos + x.roll(D / 2) * sin, sin's first half negated by the caller), queries into q [N, H, D],
// keys and values straight into an fp32 cache at `rows`. qk [N, H + Hkv, D] and v [N, Hkv, D] are views of the
// qkv output (rows apart by their own stride).
at::Tensor rotary_store(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows, int64_t H, int64_t Hkv,
                        int64_t D) {
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D &&
              cos.is_contiguous() && sin.is_contiguous() && rows.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "tfq layer: rotary_store layouts");
  const int64_t n = qk.size(0), half = D / 2;
  auto q = at::empty({n, H, D}, qk.options());
  const float* qkp = qk.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kcp = k_cache.data_ptr<float>();
  float* vcp = v_cache.data_ptr<float>();
  const int64_t qk_stride = qk.stride(0), v_stride = v.stride(0), row = Hkv * D;
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* c = cp + r * D;
      const float* s = sp + r * D;
      for (int64_t h = 0; h < H + Hkv; h++) {
        const float* x = qkp + r * qk_stride + h * D;
        float* out = h < H ? qp + (r * H + h) * D : kcp + rp[r] * row + (h - H) * D;
        for (int64_t i = 0; i < D; i++) {
          const float a = x[i] * c[i], b = x[i < half ? i + half : i - half] * s[i];
          out[i] = a + b;
        }
      }
      std::copy(vp + r * v_stride, vp + r * v_stride + row, vcp + rp[r] * row);
    }
  });
  return q;
}

// The residual and the next norm in one pass: x + d (one rounding an element), then its RMS norm by the recipe
// of tfq's rms_norm (lanes.h). x, d contiguous [N, n].
std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& w,
                                            double eps) {
  TORCH_CHECK(x.is_contiguous() && d.is_contiguous() && x.sizes() == d.sizes(), "tfq layer: add_norm layouts");
  auto sum = at::empty_like(x), y = at::empty_like(x);
  const int64_t n = w.size(0), rows = x.size(0);
  const float* xp = x.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      for (int64_t i = 0; i < n; i++) sp[r * n + i] = xp[r * n + i] + dp[r * n + i];
      tfq::rms_norm_row(sp + r * n, wp, n, e, yp + r * n);
    }
  });
  return {sum, y};
}

// SiLU of the gate times up, from gate_up [N, 2I]: silu(g_i) * u_i, the SiLU of tfq's silu and one rounding
// for the product, as silu then torch's mul.
at::Tensor silu_mul(const at::Tensor& gu, int64_t I) {
  TORCH_CHECK(gu.is_contiguous() && gu.size(1) == 2 * I, "tfq layer: silu_mul layout");
  const int64_t rows = gu.size(0);
  auto y = at::empty({rows, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* g = gp + r * 2 * I;
      const float* u = g + I;
      float* out = yp + r * I;
      for (int64_t i = 0; i < I; i += 16) {
        const int64_t cnt = std::min<int64_t>(16, I - i);
        alignas(64) float gin[16] = {}, uin[16] = {}, res[16];
        std::copy(g + i, g + i + cnt, gin);  // a short tail goes through zero-padded vectors
        std::copy(u + i, u + i + cnt, uin);
        tfq::vstore(res, tfq::vmul(tfq::vsilu(tfq::vload(gin)), tfq::vload(uin)));
        std::copy(res, res + cnt, out + i);
      }
    }
  });
  return y;
}

// Seconds spent in the linear layers ([0]) and attention ([1]) added to `clock` when given (tfq bench's
// breakdown); steady_clock costs tens of nanoseconds a reading, nothing beside a layer.
struct Clock {
  double* out;
  int slot;
  std::chrono::steady_clock::time_point t0;
  Clock(const c10::optional<at::Tensor>& clock, int s)
      : out(clock.has_value() ? clock->data_ptr<double>() : nullptr), slot(s) {
    if (out) t0 = std::chrono::steady_clock::now();
  }
  ~Clock() {
    if (out) out[slot] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

// x [N, hidden] -> the layer's output [N, hidden]; keys and values of the N rows go to the cache at `rows`.
at::Tensor layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv, const OptTensor& qkv_bias,
                 const OptTensor& q_norm, const OptTensor& k_norm, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows, double saturate,
                 const at::Tensor& table, const at::Tensor& offsets, const at::Tensor& lengths, double scale,
                 int64_t tile, int64_t split, const at::Tensor& o, const at::Tensor& post_norm,
                 const at::Tensor& gate_up, const at::Tensor& down, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, int64_t intermediate, double eps, const OptTensor& clock) {
  const int64_t n = x.size(0), hidden = x.size(1), q_out = heads * head_dim, kv_out = kv_heads * head_dim;
  const at::Tensor h = rms_norm(x, input_norm, eps);
  at::Tensor mixed_qkv;
  {
    Clock c(clock, 0);
    mixed_qkv = linear(h, qkv, qkv_bias, q_out + 2 * kv_out);
  }
  at::Tensor qk = mixed_qkv.slice(1, 0, q_out + kv_out).reshape({n, heads + kv_heads, head_dim});
  at::Tensor v = mixed_qkv.slice(1, q_out + kv_out).reshape({n, kv_heads, head_dim});
  if (q_norm.has_value()) {
    qk = at::cat({rms_norm(qk.slice(1, 0, heads), *q_norm, eps), rms_norm(qk.slice(1, heads), *k_norm, eps)}, 1);
  }
  at::Tensor q;  // cache first: new keys are read back like old ones
  if (k_cache.scalar_type() == at::kFloat && saturate <= 0) {
    q = rotary_store(qk, v, cos, sin, k_cache, v_cache, rows, heads, kv_heads, head_dim);
  } else {  // a narrow cache: torch's clamp and cast, as the store op by op
    qk = qk * cos + qk.roll({head_dim / 2}, {-1}) * sin;
    q = qk.slice(1, 0, heads);
    at::Tensor k = qk.slice(1, heads);
    if (saturate > 0) {  // narrow cache dtypes saturate instead of overflowing
      k = k.clamp(-saturate, saturate);
      v = v.clamp(-saturate, saturate);
    }
    k_cache.index_put_({rows}, k.to(k_cache.scalar_type()));
    v_cache.index_put_({rows}, v.to(v_cache.scalar_type()));
  }
  at::Tensor a;
  {
    Clock c(clock, 1);
    a = attend(q, k_cache, v_cache, table, offsets, lengths, scale, tile, split);
  }
  at::Tensor attended;
  {
    Clock c(clock, 0);
    attended = linear(a.reshape({n, q_out}), o, c10::nullopt, hidden);
  }
  const auto [x2, h2] = add_norm(x, attended, post_norm, eps);
  at::Tensor gu;
  {
    Clock c(clock, 0);
    gu = linear(h2, gate_up, c10::nullopt, 2 * intermediate);
  }
  const at::Tensor mixed = silu_mul(gu, intermediate);
  at::Tensor out;
  {
    Clock c(clock, 0);
    out = linear(mixed, down, c10::nullopt, hidden);
  }
  return x2 + out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("layer(Tensor x, Tensor input_norm, Tensor qkv, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor rows, float saturate, Tensor table, "
        "Tensor offsets, Tensor lengths, float scale, int tile, int split, Tensor o, Tensor post_norm, "
        "Tensor gate_up, Tensor down, int heads, int kv_heads, int head_dim, int intermediate, float eps, "
        "Tensor? clock) -> Tensor",
        layer);
}
