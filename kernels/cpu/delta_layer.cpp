// A Qwen3.5 hybrid's Gated DeltaNet decoder layer in one call: the same ops, in the same order, on the same
// tensors as the layer written op by op in Python (tfq/model/qwen.py, Qwen.deltanet_layer), so the same bits by
// construction; the start-up guard checks on the running build that both give every row the same output and
// leave every stream the same state.
//
//   h = rms_norm(x); proj = in_proj(h) = qkv | z | b | a; o = the recurrence (delta.cpp) over each segment of
//   rows from its slot's state; o = gated_rms_norm(o, z) per value head; out_proj(o); then the MLP (layer_parts.h)
//
// It exists for speed, as the attention layer in one call does (layer.cpp): a hybrid has three DeltaNet layers
// to each attention layer, each a dozen ops from Python between linear layers that stream the weights.
#include <torch/library.h>

#include "layer_parts.h"

namespace {

using namespace tfq::layer;

at::Tensor deltanet(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& conv,
                    const at::Tensor& A, const at::Tensor& dt_bias, const at::Tensor& conv_state,
                    const at::Tensor& rec_state, const at::Tensor& segments, const at::Tensor& save_conv,
                    const at::Tensor& save_rec, int64_t key_heads,
                    int64_t key_dim, int64_t value_heads, int64_t value_dim) {
  // the kernel's own C++ signature (delta.cpp): states by value, written through
  using Op = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, at::Tensor, at::Tensor, int64_t,
                        int64_t, int64_t, int64_t);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("tfq_cpu::deltanet", "").typed<Op>();
  return op.call(x.contiguous(), a.contiguous(), b.contiguous(), conv, A, dt_bias, conv_state, rec_state, segments,
                 save_conv, save_rec, key_heads, key_dim, value_heads, value_dim);
}

at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& w, const at::Tensor& z, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::gated_rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(o.contiguous(), w, z.contiguous(), eps);
}

// x [N, hidden] -> (the layer's output [N, hidden], in_proj's output [N, channels + Hv * dv + 2 Hv]: a draft
// verify keeps the recurrence's inputs from it, to roll rejected rows back). The segments' states are updated
// in place, and saved first where a segment says so, as delta.cpp's deltanet does.
std::tuple<at::Tensor, at::Tensor> delta_layer(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& in_proj, const at::Tensor& conv,
    const at::Tensor& A, const at::Tensor& dt_bias, const at::Tensor& norm, at::Tensor conv_state,
    at::Tensor rec_state, const at::Tensor& segments, at::Tensor save_conv, at::Tensor save_rec, int64_t key_heads,
    int64_t key_dim, int64_t value_heads, int64_t value_dim, const at::Tensor& out_proj, const at::Tensor& post_norm,
    const at::Tensor& gate_up, const at::Tensor& down, int64_t intermediate, double eps, const OptTensor& clock) {
  const int64_t n = x.size(0), hidden = x.size(1), values = value_heads * value_dim;
  const int64_t channels = 2 * key_heads * key_dim + values;
  const at::Tensor h = rms_norm(x, input_norm, eps);
  at::Tensor proj;
  {
    Clock c(clock, 0);
    proj = linear(h, in_proj, c10::nullopt, channels + values + 2 * value_heads);
  }
  const at::Tensor mixed = proj.slice(1, 0, channels), z = proj.slice(1, channels, channels + values);
  const at::Tensor b = proj.slice(1, channels + values, channels + values + value_heads);
  const at::Tensor a = proj.slice(1, channels + values + value_heads);
  at::Tensor o;
  {
    Clock c(clock, 1);
    o = deltanet(mixed, a, b, conv, A, dt_bias, conv_state, rec_state, segments, save_conv, save_rec, key_heads,
                 key_dim, value_heads, value_dim);
  }
  o = gated_rms_norm(o.reshape({n * value_heads, value_dim}), norm, z.reshape({n * value_heads, value_dim}), eps)
          .reshape({n, values});
  at::Tensor projected;
  {
    Clock c(clock, 0);
    projected = linear(o, out_proj, c10::nullopt, hidden);
  }
  return {mlp(x, projected, post_norm, gate_up, down, intermediate, eps, clock), proj};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("delta_layer(Tensor x, Tensor input_norm, Tensor in_proj, Tensor conv, Tensor A, Tensor dt_bias, "
        "Tensor norm, Tensor(a!) conv_state, Tensor(b!) rec_state, Tensor segments, Tensor(c!) save_conv, "
        "Tensor(d!) save_rec, int key_heads, int key_dim, int value_heads, int value_dim, Tensor out_proj, "
        "Tensor post_norm, Tensor gate_up, Tensor down, int intermediate, float eps, Tensor? clock) -> "
        "(Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("delta_layer", delta_layer);
}
