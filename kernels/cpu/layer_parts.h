// The pieces a decoder layer in one call is made of (layer.cpp: attention layers; delta_layer.cpp: a hybrid's
// DeltaNet layers): tfq's own ops called straight (ops.h), and the elementwise steps written with the
// roundings of the ops the layer written op by op calls (tfq/model/qwen.py). Each is a row's own work.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <vector>

#include "checks.h"
#include "lanes.h"
#include "ops.h"
#include "pool.h"
#include "quant_blob.h"

namespace tfq::layer {

using OptTensor = c10::optional<at::Tensor>;

// fp32 panels (linear.cpp) or a quantized blob (quant.cpp, uint8): the same recipe either way
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const OptTensor& bias, int64_t n) {
  return panels.scalar_type() == at::kByte ? tfq::ops::qlinear(x.contiguous(), panels, bias, n)
                                           : tfq::ops::linear(x.contiguous(), panels, bias, n);
}

inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return tfq::ops::rms_norm(x.contiguous(), w, eps);
}

inline at::Tensor attend(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                         const at::Tensor& offsets, const at::Tensor& lengths, double scale, int64_t tile,
                         int64_t split) {
  return tfq::ops::attend(q.contiguous(), kc, vc, table, offsets, lengths, scale, tile, split);
}

constexpr int64_t MOST_ROTARY = 1024;  // dimensions a head turns (Qwen's: 64 to 256)

// Rotary on queries and keys over each head's first R dimensions (R = D, or fewer for a hybrid's partial
// rotary), x_i * cos_i + x_{(i + R/2) mod R} * sin_i (two products and a sum, each rounded once: torch's x * cos +
// x.roll(R / 2) * sin, sin's first half negated by the caller), the other dimensions as they are: the queries in
// place in qkv's output [N, width] (its first H heads of D), the keys (the next Hkv heads) and the values (the
// Hkv after them) straight into an fp32 cache at `rows`; cos and sin [N, 1, R]. In place and on raw rows, because
// each tensor made between two linear layers costs a microsecond or more on cold caches. The caller has checked
// rows, the caches' shape and cos's rows (attention_part.h: check_attention).
inline void rotary_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& rows, int64_t H, int64_t Hkv, int64_t D) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) >= (H + 2 * Hkv) * D && cos.is_contiguous() && sin.is_contiguous() &&
              rows.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && cos.size(-1) <= D &&
              cos.size(-1) % 2 == 0 && cos.size(-1) <= MOST_ROTARY, "tfq layer: rotary_store layouts");
  const int64_t n = qkv.size(0), width = qkv.size(1), R = cos.size(-1), half = R / 2;
  float* qkvp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* kcp = k_cache.data_ptr<float>();
  float* vcp = v_cache.data_ptr<float>();
  const int64_t row = Hkv * D;
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    float head[MOST_ROTARY];  // a query head's values before it turns in place (no allocation a call)
    for (int64_t r = r0; r < r1; r++) {
      const float* c = cp + r * R;
      const float* s = sp + r * R;
      float* line = qkvp + r * width;
      for (int64_t h = 0; h < H + Hkv; h++) {
        const float* x = line + h * D;
        float* out = h < H ? line + h * D : kcp + rp[r] * row + (h - H) * D;
        if (h < H) {
          std::copy(x, x + R, head);
          x = head;
        }
        for (int64_t i = 0; i < R; i++) {
          const float a = x[i] * c[i], b = x[i < half ? i + half : i - half] * s[i];
          out[i] = a + b;
        }
        if (h >= H) std::copy(line + h * D + R, line + (h + 1) * D, out + R);
      }
      std::copy(line + (H + Hkv) * D, line + (H + 2 * Hkv) * D, vcp + rp[r] * row);
    }
  });
}

// The residual and the next norm in one pass: x + d (one rounding an element), then its RMS norm by the recipe
// of tfq's rms_norm (lanes.h). x, d contiguous [N, n].
inline std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& w,
                                            double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && d.is_contiguous() && x.sizes() == d.sizes(),
              "tfq layer: add_norm layouts");
  tfq::checks::vector_of("tfq layer", "add_norm's norm", w, x.size(1), "inputs");  // the row width is x's
  auto sum = tfq::pool::empty_like(x), y = tfq::pool::empty_like(x);
  const int64_t n = x.size(1), rows = x.size(0);
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
inline at::Tensor silu_mul(const at::Tensor& gu, int64_t I) {
  TORCH_CHECK(gu.is_contiguous() && gu.size(1) == 2 * I, "tfq layer: silu_mul layout");
  const int64_t rows = gu.size(0);
  auto y = tfq::pool::empty({rows, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // a decode step's few rows inline: starting the threads costs more than the work
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* g = gp + r * 2 * I;
      const float* u = g + I;
      float* out = yp + r * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) tfq::vstore(out + i, tfq::vmul(tfq::vsilu(tfq::vload(g + i)), tfq::vload(u + i)));
      if (i < I) {  // a short tail goes through zero-padded vectors
        const int64_t cnt = I - i;
        alignas(64) float gin[16] = {}, uin[16] = {}, res[16];
        std::copy(g + i, g + i + cnt, gin);
        std::copy(u + i, u + i + cnt, uin);
        tfq::vstore(res, tfq::vmul(tfq::vsilu(tfq::vload(gin)), tfq::vload(uin)));
        std::copy(res, res + cnt, out + i);
      }
    }
  });
  return y;
}

// The residual x + d (contiguous, the same shape), one rounding an element as torch's add: written here because
// torch's add builds a TensorIterator on every call, a tenth of a millisecond a decode step over a model's layers.
inline at::Tensor add_rows(const at::Tensor& x, const at::Tensor& d) {
  TORCH_CHECK(x.is_contiguous() && d.is_contiguous() && x.sizes() == d.sizes() && x.scalar_type() == at::kFloat &&
              d.scalar_type() == at::kFloat, "tfq layer: add_rows layouts");
  auto y = tfq::pool::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t n = x.numel();
  at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) yp[i] = xp[i] + dp[i];
  });
  return y;
}

// Seconds spent in the linear layers ([0]), the token mixer ([1]: attention, or a hybrid's DeltaNet recurrence)
// and a mixture ([2]: its router, experts, shared expert and its gate) added to `clock` when given (tfq bench's
// breakdown); steady_clock costs tens of nanoseconds a reading, nothing beside a layer.
struct Clock {
  double* out;
  int slot;
  std::chrono::steady_clock::time_point t0;
  Clock(const c10::optional<at::Tensor>& clock, int s)
      : out(clock.has_value() ? clock->data_ptr<double>() : nullptr), slot(s) {
    TORCH_CHECK(!out || (clock->is_contiguous() && clock->numel() > slot), "tfq clock: a clock of ",
                clock->numel(), " seconds has no slot ", slot);
    if (out) t0 = std::chrono::steady_clock::now();
  }
  ~Clock() {
    if (out) out[slot] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

// An MLP on normed rows h [N, hidden]: gate_up, SiLU times up, down (a dense layer's; a mixture's shared expert's);
// its linear layers' seconds go to the clock's `slot`
inline at::Tensor mlp_rows(const at::Tensor& h, const at::Tensor& gate_up, const at::Tensor& down,
                           int64_t intermediate, const OptTensor& clock, int slot) {
  at::Tensor act;
  {
    Clock c(clock, slot);  // 8-bit activations' blocks: SiLU times up in the gate_up kernel (q8::linear_glu)
    if (gate_up.scalar_type() == at::kByte) act = tfq::q8::linear_glu(h, gate_up, intermediate);
  }
  if (!act.defined()) {
    at::Tensor gu;
    {
      Clock c(clock, slot);
      gu = linear(h, gate_up, c10::nullopt, 2 * intermediate);
    }
    act = silu_mul(gu, intermediate);
  }
  Clock c(clock, slot);
  return linear(act, down, c10::nullopt, h.size(1));
}

// The second half of every layer, from the token mixer's output projected (`mixed`, [N, hidden]): the residual
// with the post norm, gate_up, SiLU times up, down; returns (the residual, down's output), whose sum is the layer's
// output (mlp adds them; a model's one object adds them in one pass with the next layer's input norm: add_norm).
inline std::tuple<at::Tensor, at::Tensor> mlp_part(const at::Tensor& x, const at::Tensor& mixed,
                                                   const at::Tensor& post_norm, const at::Tensor& gate_up,
                                                   const at::Tensor& down, int64_t intermediate, double eps,
                                                   const OptTensor& clock) {
  const auto [x2, h2] = add_norm(x, mixed, post_norm, eps);
  return {x2, mlp_rows(h2, gate_up, down, intermediate, clock, 0)};
}

inline at::Tensor mlp(const at::Tensor& x, const at::Tensor& mixed, const at::Tensor& post_norm,
                      const at::Tensor& gate_up, const at::Tensor& down, int64_t intermediate, double eps,
                      const OptTensor& clock) {
  const auto [x2, out] = mlp_part(x, mixed, post_norm, gate_up, down, intermediate, eps, clock);
  return add_rows(x2, out);
}

}  // namespace tfq::layer
