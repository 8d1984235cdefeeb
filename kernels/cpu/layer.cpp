// One attention decoder layer of a Qwen model in one call (a hybrid's gated attention layer too; its DeltaNet
// layers: delta_layer.cpp), and a model's layers as one object: the same ops, in the same order, on the same
// tensors as the layer written op by op in Python (tfq/model/qwen.py, Qwen.decoder_layer), so the same bits by
// construction; the start-up guard still checks, on the running build, that both give every row the same bits.
//
// Why it exists: a decode step at one lane spends far longer between its linear layers than their small ops
// need. Each of the ~25 ops of a layer, dispatched from Python, runs its interpreter and dispatcher code cold,
// after a linear layer has streamed tens of megabytes through the caches. Here a layer is one dispatch.
//
// The kernels are tfq's own ops (linear, rms_norm, attend), called straight (ops.h); the elementwise
// steps are written here with the same roundings as the ops Python calls: rotary and the store into an fp32
// cache in one pass (a narrow cache keeps torch's clamp and cast), the attention residual with the post norm,
// SiLU (lanes.h, as tfq's silu) times up. Each is a row's own work, so it is row-invariant by construction.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "attention_part.h"
#include "delta_part.h"
#include "moe_parts.h"
#include "row_facts.h"

namespace {

using namespace tfq::layer;

// A mixture-of-experts layer's attention half (its MLP: moe.cpp): (the attention residual, its post
// norm), the residual and the norm in one pass as the MLP of `layer` starts.
std::tuple<at::Tensor, at::Tensor> attention_layer(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv, const OptTensor& qkv_bias,
    const OptTensor& q_norm, const OptTensor& k_norm, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& rows, double saturate, const at::Tensor& table,
    const at::Tensor& offsets, const at::Tensor& lengths, double scale, int64_t tile, int64_t split,
    const at::Tensor& o, const at::Tensor& post_norm, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
    bool gated, const OptTensor& clock) {
  const at::Tensor attended = attention_part(rms_norm(x, input_norm, eps), qkv, qkv_bias, q_norm, k_norm, cos, sin,
                                             k_cache, v_cache, rows, saturate, table, offsets, lengths, scale, tile,
                                             split, o, heads, kv_heads, head_dim, eps, gated, clock);
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
  const at::Tensor attended = attention_part(rms_norm(x, input_norm, eps), qkv, qkv_bias, q_norm, k_norm, cos, sin,
                                             k_cache, v_cache, rows, saturate, table, offsets, lengths, scale, tile,
                                             split, o, heads, kv_heads, head_dim, eps, gated, clock);
  return mlp(x, attended, post_norm, gate_up, down, intermediate, eps, clock);
}

// A model's layers as one object, built once at load (`Stack`): every layer's weights and the model's sizes held
// here, so that a forward through all of them is one call (`stack_forward`). A dense layer is decoder_layer's ops
// (attention_part, then the MLP; a hybrid's DeltaNet layer delta_layer's: delta_part.h, then the MLP); a mixture's
// layer is its token mixer's ops (attention_layer's, or delta_part.h), the router's linear layer, moe_route and
// moe_mixture (moe_parts.h; a Qwen3.5 shared expert's gated rows added in its combine), then the residual: the same
// functions on the same tensors as the per-layer calls, in their order, so the same bits by
// construction (the start-up guard still checks it on the running build). Why: a decode step at one lane
// spent tens of microseconds a layer outside the kernels turning a layer's Python objects into the 29 arguments
// above, and a mixture's layer hundreds, in four calls from Python, on every layer of every step.

// A list of optional tensors kept as a list that is empty (none, in every layer) or holds one a layer
OptTensor at_layer(const std::vector<at::Tensor>& ts, size_t i) {
  return ts.empty() ? OptTensor() : OptTensor(ts[i]);
}

// An object a forward's call names by id (a Stack, its Caches): torch hands an op's TorchScript object arguments
// over through C++ exceptions, about 20 us a call, where an int costs nothing. An object is named from its
// constructor's last step (`enlist`: one that throws runs no destructor) to its destruction; the caller holds the
// object while it passes its id.
template <class T>
class Named : public torch::CustomClassHolder {
 public:
  Named() = default;
  Named(const Named&) = delete;  // one object an id
  Named& operator=(const Named&) = delete;
  ~Named() override {
    std::lock_guard<std::mutex> hold(lock());
    items().erase(id);
  }
  static T& at(int64_t id, const char* what) {
    std::lock_guard<std::mutex> hold(lock());
    const auto found = items().find(id);
    TORCH_CHECK(found != items().end(), "tfq stack_forward: no ", what, " ", id, " (freed, or never made)");
    return *found->second;
  }
  int64_t id = 0;

 protected:
  void enlist(T* self) {
    static int64_t next = 1;
    std::lock_guard<std::mutex> hold(lock());
    id = next++;
    items()[id] = self;
  }

 private:  // never destroyed: objects may outlive static destruction
  static std::mutex& lock() {
    static auto* m = new std::mutex();
    return *m;
  }
  static std::unordered_map<int64_t, T*>& items() {
    static auto* m = new std::unordered_map<int64_t, T*>();
    return *m;
  }
};

struct Stack : Named<Stack> {
  std::vector<at::Tensor> input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, routers;
  std::vector<c10::intrusive_ptr<tfq::moe::ExpertBank>> banks;  // a mixture's layer's experts; null in a dense one
  std::vector<at::Tensor> shared_gate_up, shared_down, shared_gate;  // a mixture's shared expert; undefined if none
  std::vector<c10::optional<DeltaTensors>> deltas;  // a hybrid's DeltaNet layer's own tensors; none elsewhere
  at::Tensor final_norm, head_panels;  // the model's final norm and head; undefined where the object has none
  int64_t vocab = 0;  // the head's outputs
  int64_t heads, kv_heads, head_dim, intermediate, experts, chosen, moe_intermediate, shared_intermediate;
  int64_t key_heads = 0, key_dim = 0, value_heads = 0, value_dim = 0;  // a hybrid's DeltaNet layers' sizes
  bool hybrid = false;  // some layer is a DeltaNet layer
  double eps, scale;
  bool gated, normalized;

  // weights: each a list of one tensor a layer, in layer order (qkv_bias, q_norm and k_norm: empty where the model
  // has none). routers: empty in a dense model, else one a layer, with no elements where the layer's MLP is dense
  // (and gate_up and down none where it is a mixture); expert_gate_ups and expert_downs: the mixtures' experts, layer
  // after layer, `experts` a layer; shared: none, or each mixture's shared expert (Qwen3.5), three a mixture (gate_up,
  // down, and its gate [1, hidden]). deltanet: a hybrid's DeltaNet layers' own tensors, layer after layer, six a
  // layer (in_proj, conv, A, dt_bias, norm, out_proj); a layer whose qkv has no elements is a DeltaNet layer (its o
  // none too). sizes: heads, kv_heads, head_dim, intermediate, experts, chosen, moe_intermediate, normalized (these
  // four 0 in a dense model), key_heads, key_dim, value_heads, value_dim (0 without DeltaNet layers),
  // shared_intermediate (0 without shared experts), vocab (0 without a head). head: none, or the model's final norm
  // and its head's panels, which a forward given logit rows runs after the last layer.
  Stack(std::vector<at::Tensor> input_norm, std::vector<at::Tensor> qkv, std::vector<at::Tensor> qkv_bias,
        std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm, std::vector<at::Tensor> o,
        std::vector<at::Tensor> post_norm, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
        std::vector<at::Tensor> routers, std::vector<at::Tensor> expert_gate_ups,
        std::vector<at::Tensor> expert_downs, std::vector<at::Tensor> shared, std::vector<at::Tensor> deltanet,
        std::vector<at::Tensor> head, std::vector<int64_t> sizes, double eps, double scale, bool gated)
      : input_norm(std::move(input_norm)), qkv(std::move(qkv)), qkv_bias(std::move(qkv_bias)),
        q_norm(std::move(q_norm)), k_norm(std::move(k_norm)), o(std::move(o)), post_norm(std::move(post_norm)),
        gate_up(std::move(gate_up)), down(std::move(down)), routers(std::move(routers)), eps(eps), scale(scale),
        gated(gated) {
    const size_t n = this->input_norm.size();
    TORCH_CHECK(n > 0 && this->qkv.size() == n && this->o.size() == n && this->post_norm.size() == n &&
                this->gate_up.size() == n && this->down.size() == n, "tfq Stack: one weight of each kind a layer");
    for (const auto* opt : {&this->qkv_bias, &this->q_norm, &this->k_norm, &this->routers})
      TORCH_CHECK(opt->empty() || opt->size() == n,
                  "tfq Stack: qkv_bias, q_norm, k_norm and routers: none, or one a layer");
    TORCH_CHECK(this->q_norm.size() == this->k_norm.size(), "tfq Stack: q_norm and k_norm, both or neither");
    TORCH_CHECK(sizes.size() == 14, "tfq Stack: sizes are heads, kv_heads, head_dim, intermediate, experts, chosen, "
                "moe_intermediate, normalized, key_heads, key_dim, value_heads, value_dim, shared_intermediate, vocab");
    heads = sizes[0], kv_heads = sizes[1], head_dim = sizes[2], intermediate = sizes[3];
    experts = sizes[4], chosen = sizes[5], moe_intermediate = sizes[6], normalized = sizes[7] != 0;
    key_heads = sizes[8], key_dim = sizes[9], value_heads = sizes[10], value_dim = sizes[11];
    shared_intermediate = sizes[12], vocab = sizes[13];
    TORCH_CHECK(head.empty() ? vocab == 0 : head.size() == 2 && vocab > 0,
                "tfq Stack: a head is its final norm and panels, with its vocab; or none, with vocab 0");
    if (!head.empty()) final_norm = head[0], head_panels = head[1];
    size_t taken = 0;  // the next DeltaNet layer's first tensor
    for (size_t i = 0; i < n; i++) {
      if (this->qkv[i].numel() > 0) {
        deltas.emplace_back();
        continue;
      }
      TORCH_CHECK(taken + 6 <= deltanet.size() && this->o[i].numel() == 0 && key_heads > 0 && value_heads > 0,
                  "tfq Stack: layer ", i, " has no qkv but not a DeltaNet layer's six tensors and sizes");
      const auto& d = deltanet;
      deltas.emplace_back(DeltaTensors{d[taken], d[taken + 1], d[taken + 2], d[taken + 3], d[taken + 4], d[taken + 5]});
      taken += 6;
    }
    TORCH_CHECK(taken == deltanet.size(), "tfq Stack: ", deltanet.size(), " DeltaNet tensors, ", taken,
                " for the layers without qkv");
    hybrid = taken > 0;
    TORCH_CHECK(expert_gate_ups.size() == expert_downs.size(), "tfq Stack: a gate_up and a down an expert");
    size_t next = 0, mixtures = 0;  // the next layer's first expert; the mixtures so far
    shared_gate_up.resize(n), shared_down.resize(n), shared_gate.resize(n);
    for (size_t i = 0; i < n; i++) {
      if (this->routers.empty() || this->routers[i].numel() == 0) {
        banks.emplace_back();
        continue;
      }
      if (!shared.empty()) {
        TORCH_CHECK(3 * mixtures + 3 <= shared.size() && shared_intermediate > 0,
                    "tfq Stack: shared experts: none, or three tensors a mixture and their size");
        shared_gate_up[i] = shared[3 * mixtures], shared_down[i] = shared[3 * mixtures + 1];
        shared_gate[i] = shared[3 * mixtures + 2];
      }
      mixtures++;
      TORCH_CHECK(experts > 0 && 0 < chosen && chosen <= experts && next + experts <= expert_gate_ups.size(),
                  "tfq Stack: layer ", i, " has a router but not ", experts, " experts to choose ", chosen, " from");
      const auto from = static_cast<std::ptrdiff_t>(next), to = static_cast<std::ptrdiff_t>(next + experts);
      banks.push_back(c10::make_intrusive<tfq::moe::ExpertBank>(
          std::vector<at::Tensor>(expert_gate_ups.begin() + from, expert_gate_ups.begin() + to),
          std::vector<at::Tensor>(expert_downs.begin() + from, expert_downs.begin() + to)));
      next += experts;
    }
    TORCH_CHECK(next == expert_gate_ups.size(), "tfq Stack: ", expert_gate_ups.size(), " experts, ", next,
                " for the layers with a router");
    TORCH_CHECK(shared.empty() || shared.size() == 3 * mixtures, "tfq Stack: ", shared.size(),
                " tensors of shared experts for ", mixtures, " mixtures (three each)");
    enlist(this);
  }
};

// The caches a Stack's forward writes, one entry a layer in the stack's order: an attention layer's key and value
// caches, a DeltaNet layer's states and their saved copies (each list empty in a model without DeltaNet layers; an
// entry without elements at a layer of the other kind). Built once per cache and handed over whole: a forward's call
// spent 40-90 us handing torch lists of every layer's tensors.
struct Caches : Named<Caches> {
  std::vector<at::Tensor> k, v, conv, rec, save_conv, save_rec;
  Caches(std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<at::Tensor> conv,
         std::vector<at::Tensor> rec, std::vector<at::Tensor> save_conv, std::vector<at::Tensor> save_rec)
      : k(std::move(k)), v(std::move(v)), conv(std::move(conv)), rec(std::move(rec)),
        save_conv(std::move(save_conv)), save_rec(std::move(save_rec)) {
    enlist(this);
  }
};

// The head over the last layer's rows that draw (`rows`: their indices): the final norm, then the head, as
// Qwen.logits runs them op by op. A forward whose every row draws in order (a decode step's) gathers nothing.
// `facts` [rows, 3] int64, where given: each logits row's (every value finite, its first largest, `stamp`).
at::Tensor logits_of(const Stack& s, const at::Tensor& h, const at::Tensor& rows, const OptTensor& clock,
                     const OptTensor& facts, int64_t stamp) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "tfq stack_forward: logit rows are a contiguous int64 vector");
  const int64_t* r = rows.data_ptr<int64_t>();
  bool all = rows.numel() == h.size(0);
  for (int64_t i = 0; all && i < rows.numel(); i++) all = r[i] == i;
  const at::Tensor normed = rms_norm(all ? h : h.index_select(0, rows), s.final_norm, s.eps);
  at::Tensor logits;
  {
    Clock c(clock, 0);  // the head is a linear layer
    logits = linear(normed, s.head_panels, c10::nullopt, s.vocab);
  }
  if (facts) {  // on this thread, which the draw's digest reads the row on next
    TORCH_CHECK(facts->dim() == 2 && facts->size(0) == logits.size(0) && facts->size(1) == 3 &&
                facts->scalar_type() == at::kLong && facts->is_contiguous(), "tfq stack_forward: facts [",
                logits.size(0), ", 3] contiguous int64, not ", facts->sizes(), " ", facts->scalar_type());
    int64_t* f = facts->data_ptr<int64_t>();
    const float* lp = logits.data_ptr<float>();
    for (int64_t r = 0; r < logits.size(0); r++) {
      const tfq::RowFacts row = tfq::row_facts(lp + r * s.vocab, s.vocab);
      f[3 * r] = row.finite, f[3 * r + 1] = row.first, f[3 * r + 2] = stamp;
    }
  }
  return logits;
}

// x [N, hidden] through the stack's layers from `first`; attention layer i's keys and values go to the caches'
// k[i] and v[i] at `rows`; DeltaNet layer i's streams' states are their conv[i] and rec[i] by `segments` (saved
// first into save_conv[i] and save_rec[i] where a segment says so). `stack` and `caches` are ids (Named): the op
// writes the caches its id names, which its schema cannot say. The other arguments are each layer's, as the
// `layer` op takes them. Returns (the output, the stack's layer count, nothing) or, where a mixture's route for
// some row was unsure (moe_route: an exp glibc's float64 value cannot round for sure, which Python's route
// answers), (that layer's token mixer's residual, the layer, its post norm): the caller runs that layer's mixture
// (its shared expert too) and goes on from the next layer. `facts`, where the head runs: logits_of's.
std::tuple<at::Tensor, int64_t, at::Tensor> stack_forward(
    const at::Tensor& x, int64_t stack, int64_t first, const at::Tensor& cos, const at::Tensor& sin, int64_t caches,
    const at::Tensor& rows, double saturate, const at::Tensor& table, const at::Tensor& offsets,
    const at::Tensor& lengths, int64_t tile, int64_t split, const at::Tensor& segments, const OptTensor& logit_rows,
    const OptTensor& clock, const OptTensor& facts, int64_t stamp) {
  const Stack* s = &Stack::at(stack, "Stack");
  TORCH_CHECK(!logit_rows || s->head_panels.defined(), "tfq stack_forward: logit rows for a Stack without a head");
  const Caches* bound = &Caches::at(caches, "Caches");
  const int64_t n = static_cast<int64_t>(s->input_norm.size());
  TORCH_CHECK(static_cast<int64_t>(bound->k.size()) == n && static_cast<int64_t>(bound->v.size()) == n,
              "tfq stack_forward: ", n, " layers, but ", bound->k.size(), " key and ", bound->v.size(),
              " value caches");
  for (const auto* states : {&bound->conv, &bound->rec, &bound->save_conv, &bound->save_rec})
    TORCH_CHECK(static_cast<int64_t>(states->size()) == (s->hybrid ? n : 0), "tfq stack_forward: ", n,
                " layers, of which DeltaNet layers: ", s->hybrid ? "some" : "none", ", but ", states->size(),
                " entries of a state list");
  TORCH_CHECK(0 <= first && first <= n, "tfq stack_forward: no layer ", first, " in ", n);
  // h: the layer's input; normed: its input norm's rows, in one pass with the previous layer's residual (a dense
  // layer's add_norm, a mixture's combine: the same sum and norm as the add then rms_norm, with one pass fewer)
  at::Tensor h = x, normed = first < n ? rms_norm(x, s->input_norm[first], s->eps) : x;
  for (int64_t i = first; i < n; i++) {
    at::Tensor mixed;  // the token mixer's output, projected
    if (s->deltas[i]) {
      const DeltaStates states{bound->conv[i], bound->rec[i], segments, bound->save_conv[i], bound->save_rec[i]};
      mixed = std::get<0>(delta_part(normed, *s->deltas[i], states, s->key_heads, s->key_dim, s->value_heads,
                                     s->value_dim, s->eps, clock));
    } else {
      mixed = attention_part(normed, s->qkv[i], at_layer(s->qkv_bias, i), at_layer(s->q_norm, i),
                             at_layer(s->k_norm, i), cos, sin, bound->k[i], bound->v[i], rows, saturate, table,
                             offsets, lengths, s->scale, tile, split, s->o[i], s->heads, s->kv_heads, s->head_dim,
                             s->eps, s->gated, clock);
    }
    const bool last = i + 1 == n;
    if (!s->banks[i]) {
      const auto [x2, out] = mlp_part(h, mixed, s->post_norm[i], s->gate_up[i], s->down[i], s->intermediate, s->eps,
                                      clock);
      if (last) h = add_rows(x2, out);
      else std::tie(h, normed) = add_norm(x2, out, s->input_norm[i + 1], s->eps);
      continue;
    }
    const auto [x2, h2] = add_norm(h.contiguous(), mixed, s->post_norm[i], s->eps);
    at::Tensor logits;
    {
      Clock c(clock, 2);  // the router beside its experts, as tfq bench counts it op by op
      logits = linear(h2, s->routers[i], c10::nullopt, s->experts);
    }
    const auto [ids, weights, unsure] = tfq::moe::moe_route(logits, s->chosen, s->normalized);
    if (unsure.numel() > 0) return {x2, i, h2};
    OptTensor shared;  // Qwen3.5's shared expert times sigmoid(its gate), added before the residual
    if (s->shared_gate[i].defined()) {
      const at::Tensor out = mlp_rows(h2, s->shared_gate_up[i], s->shared_down[i], s->shared_intermediate, clock, 2);
      at::Tensor gate;
      {
        Clock c(clock, 2);
        gate = linear(h2, s->shared_gate[i], c10::nullopt, 1);
      }
      shared = sigmoid_gate(out, gate.expand({h2.size(0), h2.size(1)}));
    }
    const tfq::moe::NextNorm next{s->input_norm[last ? i : i + 1], s->eps, normed};  // unused after the last
    h = tfq::moe::moe_mixture(h2, ids, weights, s->banks[i], s->moe_intermediate, clock, x2, last ? nullptr : &next,
                              shared);
  }
  if (logit_rows) h = logits_of(*s, h, *logit_rows, clock, facts, stamp);
  return {h, n, at::empty({0}, x.options())};
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
                  std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                  std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, double,
                  double, bool>())
      .def("id", [](const c10::intrusive_ptr<Stack>& self) { return self->id; });
  m.class_<Caches>("Caches")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("id", [](const c10::intrusive_ptr<Caches>& self) { return self->id; });
  // stack and caches: the ids of a Stack and a Caches the caller holds (their id()); it writes those caches
  m.def("stack_forward(Tensor x, int stack, int first, Tensor cos, Tensor sin, int caches, Tensor rows, "
        "float saturate, Tensor table, Tensor offsets, Tensor lengths, int tile, int split, Tensor segments, "
        "Tensor? logit_rows=None, Tensor? clock=None, Tensor(a!)? facts=None, int stamp=0) "
        "-> (Tensor, int, Tensor)");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("layer", decoder_layer);
  m.impl("attention_layer", attention_layer);
  m.impl("stack_forward", stack_forward);
}
