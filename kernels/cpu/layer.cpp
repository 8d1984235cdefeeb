// One attention decoder layer of a Qwen model in one call (a hybrid's gated attention layer too; its DeltaNet
// layers: delta_layer.cpp): the same ops, in the same order, on the same tensors as the
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
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "layer_parts.h"

namespace {

using namespace tfq::layer;

// Gated attention's output: a * sigmoid(gate) (delta.cpp's sigmoid_gate)
at::Tensor sigmoid_gate(const at::Tensor& a, const at::Tensor& gate) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::sigmoid_gate", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(a.contiguous(), gate.contiguous());
}

// What the store indexes by, checked once a call (attend checks its own tables): the rows the N keys and values go
// to, against the cache, which both stores trust (rotary_store writes rows[r] unchecked; torch's index_put_ would
// take -1 as the last row, another stream's); the caches' shape, which gives a row's width; one cos and sin row a
// query row.
void check_attention(const at::Tensor& x, const OptTensor& q_norm, const OptTensor& k_norm, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& rows,
                     int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2, "tfq layer: x [N, hidden]");
  const int64_t n = x.size(0);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == kv_heads && k_cache.size(2) == head_dim &&
              v_cache.sizes() == k_cache.sizes(), "tfq layer: the caches are ", k_cache.sizes(), " and ",
              v_cache.sizes(), ", not [rows, kv_heads ", kv_heads, ", head_dim ", head_dim, "]");
  TORCH_CHECK(cos.dim() >= 1 && cos.size(0) == n && cos.numel() == n * cos.size(-1) && sin.sizes() == cos.sizes(),
              "tfq layer: cos and sin ", cos.sizes(), " and ", sin.sizes(), ", not [", n, ", 1, R] for ", n, " rows");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "tfq layer: q_norm and k_norm, both or neither");
  tfq::checks::indices("tfq layer", "rows", rows, n, k_cache.size(0), "cache rows");
}

// The attention half: x [N, hidden] -> the attention's output projected by o [N, hidden]; keys and values of the
// N rows go to the cache at `rows`. Rotary turns each head's first cos.size(-1) dimensions; `gated` (a hybrid's
// attention): qkv's last rows are a gate, and the attention's output is times sigmoid(gate).
at::Tensor attention_part(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv,
                          const OptTensor& qkv_bias, const OptTensor& q_norm, const OptTensor& k_norm,
                          const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& rows, double saturate, const at::Tensor& table, const at::Tensor& offsets,
                          const at::Tensor& lengths, double scale, int64_t tile, int64_t split, const at::Tensor& o,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, bool gated,
                          const OptTensor& clock) {
  check_attention(x, q_norm, k_norm, cos, sin, k_cache, v_cache, rows, kv_heads, head_dim);
  const int64_t n = x.size(0), hidden = x.size(1), q_out = heads * head_dim, kv_out = kv_heads * head_dim;
  const at::Tensor h = rms_norm(x, input_norm, eps);
  at::Tensor mixed_qkv;
  {
    Clock c(clock, 0);
    mixed_qkv = linear(h, qkv, qkv_bias, q_out + 2 * kv_out + (gated ? q_out : 0));
  }
  at::Tensor qk = mixed_qkv.slice(1, 0, q_out + kv_out).reshape({n, heads + kv_heads, head_dim});
  at::Tensor v = mixed_qkv.slice(1, q_out + kv_out, q_out + 2 * kv_out).reshape({n, kv_heads, head_dim});
  if (q_norm.has_value()) {
    qk = at::cat({rms_norm(qk.slice(1, 0, heads), *q_norm, eps), rms_norm(qk.slice(1, heads), *k_norm, eps)}, 1);
  }
  at::Tensor q;  // cache first: new keys are read back like old ones
  if (k_cache.scalar_type() == at::kFloat && saturate <= 0) {
    q = rotary_store(qk, v, cos, sin, k_cache, v_cache, rows, heads, kv_heads, head_dim);
  } else {  // a narrow cache: torch's clamp and cast, as the store op by op
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

// A mixture-of-experts layer's attention half (its MLP: moe.cpp): (the attention residual, its post
// norm), the residual and the norm in one pass as the MLP of `layer` starts.
std::tuple<at::Tensor, at::Tensor> attention_layer(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv, const OptTensor& qkv_bias,
    const OptTensor& q_norm, const OptTensor& k_norm, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows, double saturate, const at::Tensor& table,
    const at::Tensor& offsets, const at::Tensor& lengths, double scale, int64_t tile, int64_t split,
    const at::Tensor& o, const at::Tensor& post_norm, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
    bool gated, const OptTensor& clock) {
  const at::Tensor attended = attention_part(x, input_norm, qkv, qkv_bias, q_norm, k_norm, cos, sin, k_cache,
                                             v_cache, rows, saturate, table, offsets, lengths, scale, tile, split, o,
                                             heads, kv_heads, head_dim, eps, gated, clock);
  return add_norm(x.contiguous(), attended, post_norm, eps);
}

// x [N, hidden] -> the layer's output [N, hidden]: the attention half, then the MLP.
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv,
                         const OptTensor& qkv_bias, const OptTensor& q_norm, const OptTensor& k_norm,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& rows, double saturate, const at::Tensor& table, const at::Tensor& offsets,
                         const at::Tensor& lengths, double scale, int64_t tile, int64_t split, const at::Tensor& o,
                         const at::Tensor& post_norm, const at::Tensor& gate_up, const at::Tensor& down,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
                         bool gated, const OptTensor& clock) {
  const at::Tensor attended = attention_part(x, input_norm, qkv, qkv_bias, q_norm, k_norm, cos, sin, k_cache,
                                             v_cache, rows, saturate, table, offsets, lengths, scale, tile, split, o,
                                             heads, kv_heads, head_dim, eps, gated, clock);
  return mlp(x, attended, post_norm, gate_up, down, intermediate, eps, clock);
}

// A dense model's layers as one object, built once at load (`Stack`): every layer's weights and the model's sizes
// held here, so that a forward through all of them is one call (`stack_forward`), decoder_layer layer after layer:
// the same function on the same tensors as the `layer` op, so the same bits by construction (the start-up guard
// still checks it on the running build). Why: a decode step at one lane spent tens of microseconds a layer
// outside the kernels turning a layer's Python objects into the 29 arguments above, on every layer of every step.

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
    h = decoder_layer(h, s->input_norm[i], s->qkv[i], at_layer(s->qkv_bias, i), at_layer(s->q_norm, i),
                                  at_layer(s->k_norm, i), cos, sin, k_caches[i], v_caches[i], rows, saturate, table,
                                  offsets, lengths, s->scale, tile, split, s->o[i], s->post_norm[i], s->gate_up[i],
                                  s->down[i], s->heads, s->kv_heads, s->head_dim, s->intermediate, s->eps, s->gated,
                                  clock);
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("layer(Tensor x, Tensor input_norm, Tensor qkv, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor rows, float saturate, Tensor table, "
        "Tensor offsets, Tensor lengths, float scale, int tile, int split, Tensor o, Tensor post_norm, "
        "Tensor gate_up, Tensor down, int heads, int kv_heads, int head_dim, int intermediate, float eps, "
        "bool gated, Tensor? clock) -> Tensor");
  m.def("attention_layer(Tensor x, Tensor input_norm, Tensor qkv, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor rows, float saturate, Tensor table, "
        "Tensor offsets, Tensor lengths, float scale, int tile, int split, Tensor o, Tensor post_norm, int heads, "
        "int kv_heads, int head_dim, float eps, bool gated, Tensor? clock) -> (Tensor, Tensor)");
  m.class_<Stack>("Stack").def(
      torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                  std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                  std::vector<at::Tensor>, std::vector<int64_t>, double, double, bool>());
  m.def("stack_forward(Tensor x, __torch__.torch.classes.tfq_cpu.Stack stack, Tensor cos, Tensor sin, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor rows, float saturate, Tensor table, Tensor offsets, "
        "Tensor lengths, int tile, int split, Tensor? clock) -> Tensor");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("layer", decoder_layer);
  m.impl("attention_layer", attention_layer);
  m.impl("stack_forward", stack_forward);
}
