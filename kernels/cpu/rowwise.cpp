// tfq's row-wise ops on the CPU: RMS norm and SiLU, each row (or element) computed by one thread in one fixed
// order, so a row's bits never depend on the rows beside it or the thread count (row invariance by construction).
//
// RMS norm of a row x of n: ss = the squares as 16 lanes (lane l: fma(x_i, x_i, acc) for i = l, l + 16, ...),
// the lanes added in the fixed tree of lanes.h; r = 1 / sqrt(ss / n + eps); y_i = (x_i * r) * w_i.
// SiLU: y = x / (1 + exp(-x)) with the exp of lanes.h.
// fma: a * b + c rounded once, element by element, by the lanes' vfma (the tests prove it on every build);
// lanes: which vector path this build's lanes take (lanes.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "lanes.h"
#include "ops.h"
#include "pool.h"
#include "row_facts.h"

namespace {

using tfq::V;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() &&
              w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0), "tfq rms_norm: x [..., n], w [n], fp32");
  auto y = tfq::pool::empty_like(x);
  const int64_t n = w.size(0), rows = n ? x.numel() / n : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) tfq::rms_norm_row(xp + r * n, wp, n, e, yp + r * n);
  });
  return y;
}

at::Tensor silu(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "tfq silu: fp32, contiguous");
  auto y = tfq::pool::empty_like(x);
  const int64_t n = x.numel();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (n + 15) / 16, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      const int64_t i0 = b * 16, cnt = std::min<int64_t>(16, n - i0);
      alignas(64) float in[16] = {}, out[16];  // a short tail goes through a zero-padded vector
      const float* src = xp + i0;
      if (cnt < 16) src = static_cast<const float*>(std::memcpy(in, xp + i0, cnt * sizeof(float)));
      const V x = tfq::vload(src);
      const V y = tfq::vsilu(x);
      if (cnt == 16) {
        tfq::vstore(yp + i0, y);
      } else {
        tfq::vstore(out, y);
        std::memcpy(yp + i0, out, cnt * sizeof(float));
      }
    }
  });
  return y;
}

at::Tensor fma_op(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && c.scalar_type() == at::kFloat &&
              a.is_contiguous() && b.is_contiguous() && c.is_contiguous() && a.sizes() == b.sizes() &&
              a.sizes() == c.sizes(), "tfq fma: three fp32 tensors of one shape, contiguous");
  auto y = tfq::pool::empty_like(a);
  const int64_t n = a.numel();
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>(), *cp = c.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) tfq::vstore(yp + i, tfq::vfma(tfq::vload(ap + i), tfq::vload(bp + i), tfq::vload(cp + i)));
  for (; i < n; i++) yp[i] = tfq::fma1(ap[i], bp[i], cp[i]);
  return y;
}

std::string lanes() { return tfq::LANES; }

// rows [R, n] fp32 -> [R, 2] int64: each row's (1 if every value is finite else 0, its first largest or -1), as the
// model's one object gives them beside its logits (row_facts.h); an op of its own for the tests and the guard
at::Tensor row_facts_op(const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous(),
              "tfq row_facts: rows [R, n] fp32, contiguous");
  auto out = at::empty({rows.size(0), 2}, rows.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = rows.data_ptr<float>();
  for (int64_t r = 0; r < rows.size(0); r++) {
    const tfq::RowFacts f = tfq::row_facts(xp + r * rows.size(1), rows.size(1));
    op[2 * r] = f.finite, op[2 * r + 1] = f.first;
  }
  return out;
}

}  // namespace

at::Tensor tfq::ops::rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return ::rms_norm(x, w, eps); }

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("lanes() -> str", lanes);
  m.def("fma(Tensor a, Tensor b, Tensor c) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu(Tensor x) -> Tensor");
  m.def("row_facts(Tensor rows) -> Tensor");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("fma", fma_op);
  m.impl("rms_norm", rms_norm);
  m.impl("silu", silu);
  m.impl("row_facts", row_facts_op);
}
