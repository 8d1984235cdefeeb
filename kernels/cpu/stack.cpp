// A dense model's attention decoder layers as one object, built once at load (`Stack`): every layer's weights
// and the model's sizes held here, so that a forward through all of them is one call (`stack_forward`), each
// layer by layer.cpp's decoder_layer in order: the same function on the same tensors as one call a layer, so the
// same bits by construction (the start-up guard still checks both on the running build).
//
// Why: a decode step at one lane spent tens of microseconds a layer outside the kernels, turning a layer's
// Python objects into the one-call layer's 29 arguments and back, on every layer of every step.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "layer_parts.h"

namespace {

using tfq::layer::OptTensor;

// A list of optional tensors kept as a list that is empty (none, in every layer) or holds one a layer
OptTensor at_layer(const std::vector<at::Tensor>& ts, size_t i) {
  return ts.empty() ? OptTensor() : OptTensor(ts[i]);
}

struct Stack : torch::CustomClassHolder {
  std::vector<at::Tensor> input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down;
  int64_t heads, kv_heads, head_dim, intermediate;
  double eps, scale;
  bool gated;

  // weights: each a list of one tensor a layer, in layer order (qkv_bias, q_norm and k_norm: empty where the model
  // has none); sizes: heads, kv_heads, head_dim, intermediate
  Stack(std::vector<at::Tensor> input_norm, std::vector<at::Tensor> qkv, std::vector<at::Tensor> qkv_bias,
        std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm, std::vector<at::Tensor> o,
        std::vector<at::Tensor> post_norm, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
        std::vector<int64_t> sizes, double eps, double scale, bool gated)
      : input_norm(std::move(input_norm)), qkv(std::move(qkv)), qkv_bias(std::move(qkv_bias)),
        q_norm(std::move(q_norm)), k_norm(std::move(k_norm)), o(std::move(o)), post_norm(std::move(post_norm)),
        gate_up(std::move(gate_up)), down(std::move(down)), eps(eps), scale(scale), gated(gated) {
    const size_t n = this->input_norm.size();
    TORCH_CHECK(n > 0 && this->qkv.size() == n && this->o.size() == n && this->post_norm.size() == n &&
                this->gate_up.size() == n && this->down.size() == n, "tfq Stack: one weight of each kind a layer");
    for (const auto* opt : {&this->qkv_bias, &this->q_norm, &this->k_norm})
      TORCH_CHECK(opt->empty() || opt->size() == n, "tfq Stack: qkv_bias, q_norm and k_norm: none, or one a layer");
    TORCH_CHECK(this->q_norm.size() == this->k_norm.size(), "tfq Stack: q_norm and k_norm, both or neither");
    TORCH_CHECK(sizes.size() == 4, "tfq Stack: sizes are heads, kv_heads, head_dim, intermediate");
    heads = sizes[0], kv_heads = sizes[1], head_dim = sizes[2], intermediate = sizes[3];
  }
};

// x [N, hidden] through every layer of the stack; layer i's keys and values go to k_caches[i] and v_caches[i] at
// `rows`. The other arguments are each layer's, as the `layer` op takes them (layer.cpp).
at::Tensor stack_forward(const at::Tensor& x, const c10::intrusive_ptr<Stack>& s, const at::Tensor& cos,
                         const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
                         const std::vector<at::Tensor>& v_caches, const at::Tensor& rows, double saturate,
                         const at::Tensor& table, const at::Tensor& offsets, const at::Tensor& lengths, int64_t tile,
                         int64_t split, const OptTensor& clock) {
  const size_t n = s->input_norm.size();
  TORCH_CHECK(k_caches.size() == n && v_caches.size() == n, "tfq stack_forward: ", n, " layers, but ",
              k_caches.size(), " key and ", v_caches.size(), " value caches");
  at::Tensor h = x;
  for (size_t i = 0; i < n; i++)
    h = tfq::layer::decoder_layer(h, s->input_norm[i], s->qkv[i], at_layer(s->qkv_bias, i), at_layer(s->q_norm, i),
                                  at_layer(s->k_norm, i), cos, sin, k_caches[i], v_caches[i], rows, saturate, table,
                                  offsets, lengths, s->scale, tile, split, s->o[i], s->post_norm[i], s->gate_up[i],
                                  s->down[i], s->heads, s->kv_heads, s->head_dim, s->intermediate, s->eps, s->gated,
                                  clock);
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.class_<Stack>("Stack").def(
      torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                  std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                  std::vector<at::Tensor>, std::vector<int64_t>, double, double, bool>());
  m.def("stack_forward(Tensor x, __torch__.torch.classes.tfq_cpu.Stack stack, Tensor cos, Tensor sin, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor rows, float saturate, Tensor table, Tensor offsets, "
        "Tensor lengths, int tile, int split, Tensor? clock) -> Tensor");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) { m.impl("stack_forward", stack_forward); }
