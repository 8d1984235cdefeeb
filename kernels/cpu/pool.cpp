// The calling thread's pool of reused tensors (pool.h), as ops: its counts (tests prove the one object reuses its
// tensors, tfq bench can say how many), and giving it back (a thread done with the kernels, as release_workers).
#include <torch/library.h>

#include "pool.h"

namespace {

// (tensors handed out again, tensors made and kept) by this thread's pool since the thread began
std::vector<int64_t> pool_counts() {
  const tfq::pool::Pool& p = tfq::pool::mine();
  return {p.again, p.made};
}

// Forgets every tensor this thread's pool keeps (their holders keep theirs); the counts stay
void pool_release() {
  for (auto& e : tfq::pool::mine().entries) e = tfq::pool::Entry{};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("pool_counts() -> int[]", pool_counts);
  m.def("pool_release() -> ()", pool_release);
}
