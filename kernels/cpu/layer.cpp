// One decoder layer of a Qwen model in one call: the same ops, in the same order, on the same tensors as the
// layer written op by op in Python (tfq/model/qwen.py, Qwen.decoder_layer), so the same bits by construction;
// the start-up guard still checks, on the running build, that both give every row the same bits.
//
// Why it exists: a decode step at one lane spends far longer between its linear layers than their small ops
// need. Each of the ~25 ops of a layer, dispatched from Python, runs its interpreter and dispatcher code cold,
// after a linear layer has streamed tens of megabytes through the caches. Here a layer is one dispatch.
//
// The kernels are tfq's own ops (linear, rms_norm, silu, attend), called through torch's dispatcher; the
// elementwise steps (rotary, residuals, SiLU times up, the cache store) are the ATen ops Python calls for
// `x * cos + x.roll(...) * sin`, `x + y`, `a * b` and `cache[rows] = k`.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <chrono>

namespace {

using OptTensor = c10::optional<at::Tensor>;

at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const OptTensor& bias, int64_t n) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>();
  return op.call(x.contiguous(), panels, bias, n);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x.contiguous(), w, eps);
}

at::Tensor activation(const at::Tensor& x) {  // tfq_cpu::silu (at::silu is torch's, not this)
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("tfq_cpu::silu", "").typed<at::Tensor(const at::Tensor&)>();
  return op.call(x.contiguous());
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                  const at::Tensor& offsets, const at::Tensor& lengths, double scale, int64_t tile, int64_t split) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tfq_cpu::attend", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, double, int64_t, int64_t)>();
  return op.call(q.contiguous(), kc, vc, table, offsets, lengths, scale, tile, split);
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
  qk = qk * cos + qk.roll({head_dim / 2}, {-1}) * sin;  // rotary, queries and keys in one go
  const at::Tensor q = qk.slice(1, 0, heads);
  at::Tensor k = qk.slice(1, heads);
  if (saturate > 0) {  // narrow cache dtypes saturate instead of overflowing
    k = k.clamp(-saturate, saturate);
    v = v.clamp(-saturate, saturate);
  }
  k_cache.index_put_({rows}, k.to(k_cache.scalar_type()));  // cache first: new keys are read back like old ones
  v_cache.index_put_({rows}, v.to(v_cache.scalar_type()));
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
  const at::Tensor x2 = x + attended;
  const at::Tensor h2 = rms_norm(x2, post_norm, eps);
  at::Tensor gu;
  {
    Clock c(clock, 0);
    gu = linear(h2, gate_up, c10::nullopt, 2 * intermediate);
  }
  const at::Tensor mixed = activation(gu.slice(1, 0, intermediate)) * gu.slice(1, intermediate);
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
