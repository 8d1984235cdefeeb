// The tensors the kernels hand back, reused: at::empty's contract (a contiguous tensor of these sizes, its contents
// undefined) from a few kept tensors that nothing else holds any more.
//
// Why: a decode step at one lane makes hundreds of small tensors (every layer's norms, residuals, linear outputs,
// the head's row) and each at::empty ran torch's allocator, malloc and a TensorImpl's construction cold, after a
// linear layer had streamed the caches out: about 2 us each, a third of what a step spends between its kernels.
//
// A kept tensor is handed out again only when this pool holds the one reference to it and to its memory (no view of
// it, no Python object, no numpy array lives): then nothing can read or write it but the caller, so reuse cannot
// change a bit anyone sees. Every kernel writes all of its output before reading it, as it must on at::empty's.
// A tensor handed to Python never comes back: its Python object, kept alive by the pool's reference after Python
// drops it, still holds one; it is forgotten when its slot is wanted. Kept per thread (no lock), at most KEPT tensors
// of at most LARGEST bytes each: a prompt's large rows go to at::empty as before.
//
// A tensor made goes to an open slot, else to the slot handed out longest ago: a decode step holds several tensors
// of one size at once (a layer's residual, its norm, the attention's output, the next sums), and a new one must not
// take the slot of one still held (it comes back when its holder lets go) while a prompt's sizes, unused since the
// prefill, sit in others. Taking a held one's slot first missed two of every three tensors of a decode step.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <array>
#include <cstdint>

namespace tfq::pool {

constexpr int KEPT = 32;
constexpr int64_t LARGEST = int64_t(1) << 20;  // bytes: a one-lane head's row (152k logits) fits
constexpr int DIMS = 4;

struct Entry {
  at::Tensor t;  // undefined: a free slot
  std::array<int64_t, DIMS> sizes{};
  int64_t dim = -1;
  at::ScalarType dtype = at::kFloat;
  bool inference = false;  // made in inference mode: handed out only there (torch refuses its in-place ops outside)
  int64_t used = 0;  // the pool's tick when it was last handed out
};

struct Pool {
  std::array<Entry, KEPT> entries;
  int64_t tick = 0;  // tensors handed out, made or again
  int64_t again = 0, made = 0;  // tensors handed out again, tensors made and kept (pool_counts)
};

inline Pool& mine() {
  static thread_local Pool pool;
  return pool;
}

// Held by the pool alone: no other tensor, view or Python object reaches it or its storage
inline bool free_to_reuse(const at::Tensor& t) {
  return t.use_count() == 1 && t.storage().use_count() == 1;
}

inline bool same(const Entry& e, at::IntArrayRef sizes, at::ScalarType dtype, bool inference) {
  if (e.dim != static_cast<int64_t>(sizes.size()) || e.dtype != dtype || e.inference != inference) return false;
  for (int64_t i = 0; i < e.dim; i++)
    if (e.sizes[i] != sizes[i]) return false;
  return true;
}

// at::empty(sizes, options) on the CPU, from the pool where a free tensor of these sizes and dtype is kept
inline at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const at::ScalarType dtype = options.dtype().toScalarType();
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (options.device().type() != at::kCPU || sizes.size() > DIMS || numel == 0 || bytes > LARGEST ||
      options.requires_grad())
    return at::empty(sizes, options);
  const bool inference = c10::InferenceMode::is_enabled();
  Pool& p = mine();
  int open = 0;  // a slot to keep a new tensor in: an empty one, else the one handed out longest ago
  for (int i = 0; i < KEPT; i++) {  // the metadata is the entry's own: only a match's tensor is touched
    Entry& e = p.entries[i];
    if (!e.t.defined()) {
      if (p.entries[open].t.defined()) open = i;
      continue;
    }
    if (p.entries[open].t.defined() && e.used < p.entries[open].used) open = i;
    if (!same(e, sizes, dtype, inference) || !free_to_reuse(e.t)) continue;
    if (e.t.sizes() == sizes && e.t.is_contiguous() && e.t.storage_offset() == 0 &&
        static_cast<int64_t>(e.t.storage().nbytes()) >= bytes)
    {
      p.again++;
      e.used = ++p.tick;
      return e.t;  // (sizes, layout and memory checked again: a holder may have resized it in place)
    }
  }
  at::Tensor made = at::empty(sizes, options);
  Entry& e = p.entries[open];  // forgetting a tensor held elsewhere changes nothing for its holder
  e.t = made;
  e.dim = static_cast<int64_t>(sizes.size());
  for (int64_t i = 0; i < e.dim; i++) e.sizes[i] = sizes[i];
  e.dtype = dtype;
  e.inference = inference;
  e.used = ++p.tick;
  p.made++;
  return made;
}

inline at::Tensor empty_like(const at::Tensor& x) {
  return x.is_contiguous() ? empty(x.sizes(), x.options()) : at::empty_like(x);
}

}  // namespace tfq::pool
