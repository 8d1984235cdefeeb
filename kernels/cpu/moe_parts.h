// A mixture of experts' two recipes (moe.cpp registers them as ops; layer.cpp's Stack runs them inside a model's
// one-object forward): the same functions either way, so the same bits by construction.
#pragma once

#include <torch/custom_class.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "checks.h"
#include "layer_parts.h"
#include "quant_blob.h"

namespace tfq::moe {

using namespace tfq::layer;

// exp(d) as the float32 nearest the exact value, or false where glibc's float64 value cannot decide it
// (tfq/nearest.py's test: within 2^9 float64 units of a float32 midpoint, or below float32's normals)
inline bool exp32(double d, float& out) {
  const double e = std::exp(d);
  if (!(e >= 1.1754943508222875e-38)) return false;  // float32's smallest normal (and NaN)
  uint64_t bits;
  std::memcpy(&bits, &e, sizeof bits);
  const int64_t low = static_cast<int64_t>(bits & ((uint64_t{1} << 29) - 1)) - (int64_t{1} << 28);
  if (std::llabs(low) <= (int64_t{1} << 9)) return false;
  out = static_cast<float>(e);
  return true;
}

// A blob's layout: its first header's magic (a blob's segments share their layout; segments_of checks the rest),
// or 0 for fp32 panels
inline int32_t magic_of(const at::Tensor& w) {
  int32_t magic = 0;
  if (w.scalar_type() == at::kByte && w.dim() == 1 && w.numel() >= tfq::blob::HEADER)
    std::memcpy(&magic, w.data_ptr<uint8_t>(), sizeof magic);
  return magic == tfq::blob::MAGIC || magic == tfq::blob::MAGIC_Q8 ? magic : 0;
}

// A blob's segments, for a product [*, k] -> [*, n]
inline const std::vector<tfq::blob::Segment>& checked(const std::vector<tfq::blob::Segment>& segs, int64_t k,
                                                      int64_t n) {
  TORCH_CHECK(segs[0].h.k == k && segs.back().first + segs.back().h.n == n, "tfq moe_mixture: an expert's shape");
  return segs;
}

// A mixture's experts, held once: a call passes one object instead of two lists of `experts` tensors (whose
// conversion from Python cost tens of microseconds a layer). Blobs' segments are read here once: read at every
// step, sixteen experts' headers a layer were as many cache and TLB misses after the weights streamed by.
struct ExpertBank : torch::CustomClassHolder {
  std::vector<at::Tensor> gate_ups, downs;
  std::vector<int32_t> magics;  // an expert's blobs' layout where its two share one, else 0 (fp32 panels)
  std::vector<std::vector<tfq::blob::Segment>> gate_up_segs, down_segs;  // empty where its magic is 0
  ExpertBank(std::vector<at::Tensor> g, std::vector<at::Tensor> d) : gate_ups(std::move(g)), downs(std::move(d)) {
    TORCH_CHECK(gate_ups.size() == downs.size(), "tfq ExpertBank: a gate_up and a down an expert");
    for (size_t e = 0; e < gate_ups.size(); e++) {
      const int32_t magic = magic_of(gate_ups[e]) == magic_of(downs[e]) ? magic_of(gate_ups[e]) : 0;
      magics.push_back(magic);
      gate_up_segs.push_back(magic ? tfq::blob::segments_of(gate_ups[e]) : std::vector<tfq::blob::Segment>());
      down_segs.push_back(magic ? tfq::blob::segments_of(downs[e]) : std::vector<tfq::blob::Segment>());
    }
  }
};

// A float buffer of n a call reuses from the last (this thread's, where n is at most 64k floats), else one of its own.
// Why: at one lane every tensor a mixture's layer made after its experts' weights had streamed through the caches
// cost microseconds of cold allocator code and data (docs/measurements.md); a kept buffer costs none of that.
struct Scratch {
  at::Tensor own;
  float* data;
  Scratch(std::vector<float>& kept, int64_t n) {
    if (n <= (int64_t{1} << 16)) {
      if (static_cast<int64_t>(kept.size()) < n) kept.resize(static_cast<size_t>(n));
      data = kept.data();
    } else {
      own = at::empty({n}, at::kFloat);
      data = own.data_ptr<float>();
    }
  }
};

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t chosen,
                                                                bool normalized) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && chosen > 0 &&
              chosen <= logits.size(1), "tfq moe_route: logits [rows, experts] float32, 0 < chosen <= experts");
  const int64_t rows = logits.size(0), E = logits.size(1);
  auto ids = tfq::pool::empty({rows, chosen}, logits.options().dtype(at::kLong));
  auto weights = tfq::pool::empty({rows, chosen}, logits.options());
  std::vector<int64_t> unsure;
  const float* x = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  // kept between calls, as Scratch's; named through references (a lambda naming a thread_local reads its own thread's)
  thread_local std::vector<float> p_kept;
  thread_local std::vector<int64_t> order_kept;
  std::vector<float>& p = p_kept;
  std::vector<int64_t>& order = order_kept;
  p.resize(static_cast<size_t>(E)), order.resize(static_cast<size_t>(E));
  for (int64_t r = 0; r < rows; r++) {
    const float* row = x + r * E;
    float top = row[0];
    bool sure = true;
    for (int64_t i = 0; i < E && sure; i++) {
      sure = std::isfinite(row[i]);
      top = std::max(top, row[i]);
    }
    double total = 0.0;  // in id order
    for (int64_t i = 0; i < E && sure; i++) {
      sure = exp32(static_cast<double>(row[i]) - static_cast<double>(top), p[i]);
      total += static_cast<double>(p[i]);
    }
    if (!sure) {  // zeros, as the caller's route fills them
      std::fill(ip + r * chosen, ip + (r + 1) * chosen, int64_t{0});
      std::fill(wp + r * chosen, wp + (r + 1) * chosen, 0.0f);
      unsure.push_back(r);
      continue;
    }
    const float sum = static_cast<float>(total);
    for (int64_t i = 0; i < E; i++) p[i] = p[i] / sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + chosen, order.end(), [&](int64_t a, int64_t b) {
      return p[a] > p[b] || (p[a] == p[b] && a < b);  // ties to the lower id
    });
    float kept = 0.0f;  // in rank order
    for (int64_t j = 0; j < chosen; j++) {
      ip[r * chosen + j] = order[j];
      wp[r * chosen + j] = p[order[j]];
      kept = kept + p[order[j]];
    }
    if (normalized) {
      for (int64_t j = 0; j < chosen; j++) wp[r * chosen + j] = wp[r * chosen + j] / kept;
    }
  }
  auto which = at::empty({static_cast<int64_t>(unsure.size())}, logits.options().dtype(at::kLong));
  std::copy(unsure.begin(), unsure.end(), which.data_ptr<int64_t>());
  return {ids, weights, which};
}

// The next layer's input norm of the mixture's output, made in the combine's pass (a model's one object): its
// weight, and the rows it fills, [rows, hidden]
struct NextNorm {
  const at::Tensor& w;
  double eps;
  at::Tensor& out;
};

// `shared`, where given ([rows, hidden]: a shared expert's gated output), is added to each row's sum, then
// `residual` (one rounding each, as `residual + (mixture + shared)` would): the layer's residual in the combine's
// pass rather than more ops; so is `next`'s norm, by rms_norm's recipe
inline at::Tensor moe_mixture(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& weights,
                              const c10::intrusive_ptr<ExpertBank>& bank, int64_t intermediate,
                              const OptTensor& clock, const OptTensor& residual = c10::nullopt,
                              const NextNorm* next = nullptr, const OptTensor& shared = c10::nullopt) {
  const std::vector<at::Tensor>& gate_ups = bank->gate_ups;
  const std::vector<at::Tensor>& downs = bank->downs;
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong &&
              weights.scalar_type() == at::kFloat && ids.dim() == 2 && ids.sizes() == weights.sizes() &&
              ids.size(0) == h.size(0), "tfq moe_mixture: layouts");
  const at::Tensor x = h.contiguous(), id = ids.contiguous(), w = weights.contiguous();
  const int64_t rows = x.size(0), hidden = x.size(1), chosen = id.size(1), pairs = rows * chosen;
  const int64_t* ip = id.data_ptr<int64_t>();
  tfq::checks::within("tfq moe_mixture", "ids", ip, pairs, static_cast<int64_t>(gate_ups.size()), "experts");
  // a row's output starts from its first route's
  TORCH_CHECK(chosen > 0 || rows == 0, "tfq moe_mixture: each row needs at least one expert, not ids ", id.sizes());
  // buffers kept between calls (Scratch's reason), named through references: a lambda that names a thread_local
  // reads its own thread's
  thread_local std::vector<int64_t> order_kept;
  thread_local std::vector<int64_t> at_pair_kept;
  std::vector<int64_t>& order = order_kept;  // the pairs grouped by expert, in (row, rank) order within a group
  order.resize(static_cast<size_t>(pairs));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ip[a] < ip[b]; });
  struct Group {
    int64_t expert, start, end;
  };
  thread_local std::vector<Group> groups_kept;
  std::vector<Group>& groups = groups_kept;
  groups.clear();
  for (int64_t start = 0, end; start < pairs; start = end) {
    for (end = start + 1; end < pairs && ip[order[end]] == ip[order[start]];) end++;
    groups.push_back({ip[order[start]], start, end});
  }
  // each pair's row, grouped by expert; where one row chose each of its experts once (a decode step's lane), every
  // group is that row alone, read where it is
  const float* xp = x.data_ptr<float>();
  const bool in_place = rows == 1 && static_cast<int64_t>(groups.size()) == pairs;
  at::Tensor picked;
  if (!in_place) {
    picked = tfq::pool::empty({pairs, hidden}, x.options());
    float* pp = picked.data_ptr<float>();
    for (int64_t q = 0; q < pairs; q++) std::memcpy(pp + q * hidden, xp + (order[q] / chosen) * hidden, hidden * 4);
  }
  const auto row_of = [&](int64_t q) { return in_place ? xp : picked.data_ptr<float>() + q * hidden; };
  thread_local std::vector<float> grouped_kept;
  const Scratch grouped(grouped_kept, pairs * hidden);
  // every chosen expert in blobs of one layout (quant.cpp's or quant_q8.cpp's): all their products in one
  // parallel region, by that layout's linear_many
  int32_t magic = groups.empty() ? 0 : bank->magics[groups[0].expert];
  for (const Group& g : groups)
    if (bank->magics[g.expert] != magic) magic = 0;
  const auto many = magic == tfq::blob::MAGIC      ? &tfq::quant::linear_many
                    : magic == tfq::blob::MAGIC_Q8 ? &tfq::q8::linear_many
                                                   : nullptr;
  if (many) {
    // 8-bit activations' blobs that pair: SiLU times up in the gate_up kernel (q8::linear_many_glu)
    bool glu = magic == tfq::blob::MAGIC_Q8;
    for (const Group& g : groups) glu = glu && tfq::q8::glu_pairs(bank->gate_up_segs[g.expert], intermediate);
    const int64_t width = glu ? intermediate : 2 * intermediate;
    thread_local std::vector<float> gu_kept;
    const Scratch gu(gu_kept, pairs * width);
    thread_local std::vector<tfq::quant::Product> products_kept;
    std::vector<tfq::quant::Product>& products = products_kept;
    products.clear();
    for (const Group& g : groups)
      products.push_back({row_of(g.start), g.end - g.start,
                          &checked(bank->gate_up_segs[g.expert], hidden, 2 * intermediate),
                          gu.data + g.start * width, width, nullptr});
    {
      Clock c(clock, 2);
      if (glu) tfq::q8::linear_many_glu(products, intermediate);
      else many(products);
    }
    // a row's own: the same bits a group at a time
    const at::Tensor act = glu ? at::Tensor() : silu_mul(at::from_blob(gu.data, {pairs, width}, x.options()),
                                                         intermediate);
    const float* ap = glu ? gu.data : act.data_ptr<float>();
    products.clear();
    for (const Group& g : groups)
      products.push_back({ap + g.start * intermediate, g.end - g.start,
                          &checked(bank->down_segs[g.expert], intermediate, hidden), grouped.data + g.start * hidden,
                          hidden, nullptr});
    Clock c(clock, 2);
    many(products);
  } else {
    for (const Group& g : groups) {
      at::Tensor gu, y;
      {
        Clock c(clock, 2);
        gu = linear(in_place ? x : picked.slice(0, g.start, g.end), gate_ups[g.expert], c10::nullopt,
                    2 * intermediate);
      }
      const at::Tensor act = silu_mul(gu, intermediate);
      {
        Clock c(clock, 2);
        y = linear(act, downs[g.expert], c10::nullopt, hidden);
      }
      std::memcpy(grouped.data + g.start * hidden, y.contiguous().data_ptr<float>(),
                  static_cast<size_t>((g.end - g.start) * hidden) * sizeof(float));
    }
  }
  std::vector<int64_t>& at_pair = at_pair_kept;  // (row, rank) -> its place among the grouped outputs
  at_pair.resize(static_cast<size_t>(pairs));
  for (int64_t q = 0; q < pairs; q++) at_pair[order[q]] = q;
  auto out = tfq::pool::empty({rows, hidden}, x.options());
  const at::Tensor base = residual.has_value() ? residual->contiguous() : at::Tensor();
  TORCH_CHECK(!base.defined() || (base.sizes() == out.sizes() && base.scalar_type() == at::kFloat),
              "tfq moe_mixture: the residual ", base.sizes(), ", not the rows' ", out.sizes());
  const float* bp = base.defined() ? base.data_ptr<float>() : nullptr;
  const at::Tensor added = shared.has_value() ? shared->contiguous() : at::Tensor();
  TORCH_CHECK(!added.defined() || (added.sizes() == out.sizes() && added.scalar_type() == at::kFloat),
              "tfq moe_mixture: the shared expert's rows ", added.sizes(), ", not the rows' ", out.sizes());
  const float* sp = added.defined() ? added.data_ptr<float>() : nullptr;
  const float* gp = grouped.data;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* np = nullptr;  // the next norm's rows, its weight
  const float* nw = nullptr;
  if (next) {
    tfq::checks::vector_of("tfq moe_mixture", "the next norm", next->w, hidden, "hidden");
    next->out = tfq::pool::empty({rows, hidden}, x.options());
    np = next->out.data_ptr<float>();
    nw = next->w.data_ptr<float>();
  }
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      float* total = op + r * hidden;
      const float* first = gp + at_pair[r * chosen] * hidden;
      const float w0 = wp[r * chosen];
      for (int64_t i = 0; i < hidden; i++) total[i] = first[i] * w0;
      for (int64_t j = 1; j < chosen; j++) {  // in the row's rank order
        const float* y = gp + at_pair[r * chosen + j] * hidden;
        const float wj = wp[r * chosen + j];
        for (int64_t i = 0; i < hidden; i++) total[i] = total[i] + y[i] * wj;
      }
      if (sp)
        for (int64_t i = 0; i < hidden; i++) total[i] = total[i] + sp[r * hidden + i];
      if (bp)
        for (int64_t i = 0; i < hidden; i++) total[i] = bp[r * hidden + i] + total[i];
      if (np) tfq::rms_norm_row(total, nw, hidden, static_cast<float>(next->eps), np + r * hidden);
    }
  });
  return out;
}

}  // namespace tfq::moe
