// The indices and shapes a kernel trusts, checked once a call before any thread runs: a page-accounting bug (a
// cache row past the cache, a key table entry past the pool, a slot past the states) or a weight of the wrong
// size is then a RuntimeError naming the op, the index and the bound, never a write or a read past the memory.
// A table is one vectorized pass (about 2 us for 32768 entries here), nothing beside the work that reads through it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace tfq::checks {

// Every idx[i] (i < n) in [0, bound): `op: what[i] = v is outside the <bound> <of>` otherwise.
inline void within(const char* op, const char* what, const int64_t* idx, int64_t n, int64_t bound, const char* of) {
  // the largest entry as unsigned (a negative index is a huge one): a max reduction the compiler vectorizes
  // (an or of compares did not vectorize, and took 10-16 us, not 2, for 32768 entries here)
  uint64_t top = 0;
  for (int64_t i = 0; i < n; i++) top = std::max(top, static_cast<uint64_t>(idx[i]));
  if (n == 0 || top < static_cast<uint64_t>(bound)) return;
  for (int64_t i = 0; i < n; i++)  // only to name the first one
    TORCH_CHECK(idx[i] >= 0 && idx[i] < bound, op, ": ", what, "[", i, "] = ", idx[i], " is outside the ", bound,
                " ", of);
}

// An int64 tensor of `count` entries, contiguous (offsets, lengths). Returns its data.
inline const int64_t* int64s(const char* op, const char* what, const at::Tensor& t, int64_t count) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == count, op, ": ", what, " ", count,
              " contiguous int64s, not ", t.numel(), " ", t.scalar_type());
  return t.data_ptr<int64_t>();
}

// An index tensor: int64, contiguous, `count` entries, each in [0, bound). Returns its data.
inline const int64_t* indices(const char* op, const char* what, const at::Tensor& t, int64_t count, int64_t bound,
                              const char* of) {
  const int64_t* p = int64s(op, what, t, count);
  within(op, what, p, count, bound, of);
  return p;
}

// A weight vector the kernel reads n floats of (a norm's weights, a bias, a head's constants): `of` names n
inline void vector_of(const char* op, const char* what, const at::Tensor& w, int64_t n, const char* of) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n, op, ": ", what, " has ", w.numel(), " weights for ", n, " ", of);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous(), op, ": ", what, " fp32, contiguous");
}

}  // namespace tfq::checks
