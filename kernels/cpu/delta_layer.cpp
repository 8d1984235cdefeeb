// A Qwen3.5 hybrid's Gated DeltaNet decoder layer in one call: the same ops, in the same order, on the same
// tensors as the layer written op by op in Python (tfq/model/qwen.py, Qwen.deltanet_layer), so the same bits by
// construction: the token mixer (delta_part.h), then the MLP (layer_parts.h). The start-up guard checks on the
// running build that both give every row the same output and leave every stream the same state.
//
// It exists for speed, as the attention layer in one call does (layer.cpp): a hybrid has three DeltaNet layers
// to each attention layer, each a dozen ops from Python between linear layers that stream the weights.
#include <torch/library.h>

#include "delta_part.h"

namespace {

using namespace tfq::layer;

// x [N, hidden] -> (the layer's output [N, hidden], in_proj's output [N, channels + Hv * dv + 2 Hv]: a draft
// verify keeps the recurrence's inputs from it, to roll rejected rows back). The segments' states are updated
// in place, and saved first where a segment says so, as delta.cpp's deltanet does.
std::tuple<at::Tensor, at::Tensor> delta_layer(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& in_proj, const at::Tensor& conv,
    const at::Tensor& A, const at::Tensor& dt_bias, const at::Tensor& norm, at::Tensor conv_state,
    at::Tensor rec_state, const at::Tensor& segments, at::Tensor save_conv, at::Tensor save_rec, int64_t key_heads,
    int64_t key_dim, int64_t value_heads, int64_t value_dim, const at::Tensor& out_proj, const at::Tensor& post_norm,
    const at::Tensor& gate_up, const at::Tensor& down, int64_t intermediate, double eps, const OptTensor& clock) {
  const auto [projected, proj] = delta_part(rms_norm(x, input_norm, eps),
                                            DeltaTensors{in_proj, conv, A, dt_bias, norm, out_proj},
                                            DeltaStates{conv_state, rec_state, segments, save_conv, save_rec},
                                            key_heads, key_dim, value_heads, value_dim, eps, clock);
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
