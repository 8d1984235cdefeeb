// The attention half of a decoder layer (layer.cpp: a layer in one call, and a model's layers as one object), from
// the pieces of layer_parts.h: the same ops in the same order as the layer written op by op (tfq/model/qwen.py).
#pragma once

#include "layer_parts.h"

namespace tfq::layer {

// Gated attention's output: a * sigmoid(gate) (delta.cpp's sigmoid_gate)
inline at::Tensor sigmoid_gate(const at::Tensor& a, const at::Tensor& gate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::sigmoid_gate", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(a.contiguous(), gate.contiguous());
}

// What the store indexes by, checked once a call (attend checks its own tables): the rows the N keys and values go
// to, against the cache, which both stores trust (rotary_store writes rows[r] unchecked; torch's index_put_ would
// take -1 as the last row, another stream's); the caches' shape, which gives a row's width; one cos and sin row a
// query row.
inline void check_attention(const at::Tensor& h, const OptTensor& q_norm, const OptTensor& k_norm,
                            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& rows, int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(h.dim() == 2, "tfq layer: the normed rows [N, hidden]");
  const int64_t n = h.size(0);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == kv_heads && k_cache.size(2) == head_dim &&
              v_cache.sizes() == k_cache.sizes(), "tfq layer: the caches are ", k_cache.sizes(), " and ",
              v_cache.sizes(), ", not [rows, kv_heads ", kv_heads, ", head_dim ", head_dim, "]");
  TORCH_CHECK(cos.dim() >= 1 && cos.size(0) == n && cos.numel() == n * cos.size(-1) && sin.sizes() == cos.sizes(),
              "tfq layer: cos and sin ", cos.sizes(), " and ", sin.sizes(), ", not [", n, ", 1, R] for ", n, " rows");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "tfq layer: q_norm and k_norm, both or neither");
  tfq::checks::indices("tfq layer", "rows", rows, n, k_cache.size(0), "cache rows");
}

// Qwen3's q and k norms, each head's row of D normed in place in qkv's output (its first H + Hkv heads): the
// recipe of tfq's rms_norm (lanes.h) a head at a time, as the layer op by op norms the q and k slices. In place,
// because a layer's small ops each cost microseconds on caches a linear layer has just flushed: no copies of the
// slices, no concatenation.
inline void norm_heads(at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, int64_t H, int64_t Hkv,
                       int64_t D, double eps) {
  tfq::checks::vector_of("tfq layer", "q_norm", q_norm, D, "head_dim");
  tfq::checks::vector_of("tfq layer", "k_norm", k_norm, D, "head_dim");
  TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) >= (H + Hkv) * D, "tfq layer: norm_heads layout");
  float* p = qkv.data_ptr<float>();
  const float* qn = q_norm.data_ptr<float>();
  const float* kn = k_norm.data_ptr<float>();
  const int64_t rows = qkv.size(0), width = qkv.size(1);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (int64_t h = 0; h < H + Hkv; h++) {
        float* x = p + r * width + h * D;
        tfq::rms_norm_row(x, h < H ? qn : kn, D, e, x);
      }
  });
}

// The attention half: h, the input norm's rows [N, hidden] -> the attention's output projected by o [N, hidden];
// keys and values of the N rows go to the cache at `rows`. The caller norms (a model's one object in one pass with
// the previous layer's residual: add_norm, or a mixture's combine). Rotary turns each head's first cos.size(-1)
// dimensions; `gated` (a hybrid's attention): qkv's last rows are a gate, and the attention's output is times
// sigmoid(gate).
inline at::Tensor attention_part(const at::Tensor& h, const at::Tensor& qkv,
                                 const OptTensor& qkv_bias, const OptTensor& q_norm, const OptTensor& k_norm,
                                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                                 const at::Tensor& rows, double saturate, const at::Tensor& table,
                                 const at::Tensor& offsets, const at::Tensor& lengths, double scale, int64_t tile,
                                 int64_t split, const at::Tensor& o, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                 double eps, bool gated, const OptTensor& clock) {
  check_attention(h, q_norm, k_norm, cos, sin, k_cache, v_cache, rows, kv_heads, head_dim);
  const int64_t n = h.size(0), hidden = h.size(1), q_out = heads * head_dim, kv_out = kv_heads * head_dim;
  at::Tensor mixed_qkv;
  {
    Clock c(clock, 0);
    mixed_qkv = linear(h, qkv, qkv_bias, q_out + 2 * kv_out + (gated ? q_out : 0));
  }
  if (q_norm.has_value()) norm_heads(mixed_qkv, *q_norm, *k_norm, heads, kv_heads, head_dim, eps);
  at::Tensor q;  // cache first: new keys are read back like old ones
  if (k_cache.scalar_type() == at::kFloat && saturate <= 0) {
    rotary_store(mixed_qkv, cos, sin, k_cache, v_cache, rows, heads, kv_heads, head_dim);
    q = mixed_qkv.as_strided({n, heads, head_dim}, {mixed_qkv.size(1), head_dim, 1});  // the turned queries
  } else {  // a narrow cache: torch's clamp and cast, as the store op by op
    at::Tensor qk = mixed_qkv.slice(1, 0, q_out + kv_out).reshape({n, heads + kv_heads, head_dim});
    at::Tensor v = mixed_qkv.slice(1, q_out + kv_out, q_out + 2 * kv_out).reshape({n, kv_heads, head_dim});
    const int64_t R = cos.size(-1);  // a hybrid turns only the first R dimensions (partial rotary)
    const at::Tensor turned = qk.slice(2, 0, R);
    qk = R == head_dim ? turned * cos + turned.roll({R / 2}, {-1}) * sin
                       : at::cat({turned * cos + turned.roll({R / 2}, {-1}) * sin, qk.slice(2, R)}, 2);
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
  a = a.reshape({n, q_out});
  if (gated) a = sigmoid_gate(a, mixed_qkv.slice(1, q_out + 2 * kv_out));
  at::Tensor attended;
  {
    Clock c(clock, 0);
    attended = linear(a, o, c10::nullopt, hidden);
  }
  return attended;
}

}  // namespace tfq::layer
