// The token-mixer half of a Qwen3.5 hybrid's Gated DeltaNet layer (delta_layer.cpp: the layer in one call;
// layer.cpp: a model's layers as one object), from the pieces of layer_parts.h: the same ops in the same order as
// the layer written op by op (tfq/model/qwen.py, Qwen.deltanet_layer).
//
//   h = rms_norm(x) (by the caller); proj = in_proj(h) = qkv | z | b | a; o = the recurrence (delta.cpp) over
//   each segment of rows from its slot's state; o = gated_rms_norm(o, z) per value head; out_proj(o)
#pragma once

#include "layer_parts.h"

namespace tfq::layer {

inline at::Tensor deltanet(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& conv,
                           const at::Tensor& A, const at::Tensor& dt_bias, const at::Tensor& conv_state,
                           const at::Tensor& rec_state, const at::Tensor& segments, const at::Tensor& save_conv,
                           const at::Tensor& save_rec, int64_t key_heads, int64_t key_dim, int64_t value_heads,
                           int64_t value_dim) {
  // the kernel's own C++ signature (delta.cpp): states by value, written through
  using Op = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, at::Tensor, at::Tensor, int64_t,
                        int64_t, int64_t, int64_t);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tfq_cpu::deltanet", "").typed<Op>();
  return op.call(x.contiguous(), a.contiguous(), b.contiguous(), conv, A, dt_bias, conv_state, rec_state, segments,
                 save_conv, save_rec, key_heads, key_dim, value_heads, value_dim);
}

inline at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& w, const at::Tensor& z, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::gated_rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(o.contiguous(), w, z.contiguous(), eps);
}

// A DeltaNet layer's own tensors (its projections are linear layers' panels or blobs)
struct DeltaTensors {
  at::Tensor in_proj, conv, A, dt_bias, norm, out_proj;
};

// One layer's streams' states this forward (updated in place; saved first where a segment says so)
struct DeltaStates {
  at::Tensor conv, rec, segments, save_conv, save_rec;
};

// h, the input norm's rows [N, hidden] -> (the token mixer's output projected by out_proj [N, hidden], in_proj's
// output [N, channels + Hv * dv + 2 Hv]: a draft verify keeps the recurrence's inputs from it, to roll rejected
// rows back).
inline std::tuple<at::Tensor, at::Tensor> delta_part(const at::Tensor& h, const DeltaTensors& w, const DeltaStates& s,
                                                     int64_t key_heads, int64_t key_dim, int64_t value_heads,
                                                     int64_t value_dim, double eps, const OptTensor& clock) {
  const int64_t n = h.size(0), hidden = h.size(1), values = value_heads * value_dim;
  const int64_t channels = 2 * key_heads * key_dim + values;
  at::Tensor proj;
  {
    Clock c(clock, 0);
    proj = linear(h, w.in_proj, c10::nullopt, channels + values + 2 * value_heads);
  }
  const at::Tensor mixed = proj.slice(1, 0, channels), z = proj.slice(1, channels, channels + values);
  const at::Tensor b = proj.slice(1, channels + values, channels + values + value_heads);
  const at::Tensor a = proj.slice(1, channels + values + value_heads);
  at::Tensor o;
  {
    Clock c(clock, 1);
    o = deltanet(mixed, a, b, w.conv, w.A, w.dt_bias, s.conv, s.rec, s.segments, s.save_conv, s.save_rec, key_heads,
                 key_dim, value_heads, value_dim);
  }
  o = gated_rms_norm(o.reshape({n * value_heads, value_dim}), w.norm, z.reshape({n * value_heads, value_dim}), eps)
          .reshape({n, values});
  at::Tensor projected;
  {
    Clock c(clock, 0);
    projected = linear(o, w.out_proj, c10::nullopt, hidden);
  }
  return {projected, proj};
}

}  // namespace tfq::layer
