// weights_memory and lasting_memory (memory.h): 2 MiB pages for weights, and blocks of them shared by small blobs.
#include "memory.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tfq {
namespace {

const auto BYTES = at::TensorOptions().dtype(at::kByte);

// 2 MiB-aligned memory of whole 2 MiB pages asked for as huge ones (nullptr where the system cannot)
void* huge_pages(size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  void* mem = nullptr;
  if (posix_memalign(&mem, static_cast<size_t>(HUGE_PAGE), n) != 0) return nullptr;
  madvise(mem, n / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE);  // advice only: without it the pages are small, same bits
  return mem;
#else
  (void)n;
  return nullptr;
#endif
}

std::atomic<int64_t> blocks_alive{0};

struct Block {
  void* mem;
  explicit Block(void* m) : mem(m) { blocks_alive++; }
  ~Block() {
    std::free(mem);
    blocks_alive--;
  }
};

// Hands out the current block's next bytes; a new block when it is full or gone. The arena only watches its
// block (weak_ptr): each blob holds it (its deleter's shared_ptr), so the last blob freed frees it.
class Arena {
 public:
  static constexpr size_t BLOCK = size_t(32) << 20;

  at::Tensor take(size_t n) {
    std::lock_guard<std::mutex> hold(mu_);
    std::shared_ptr<Block> block = current_.lock();
    if (!block || used_ + n > BLOCK) {
      void* mem = huge_pages(BLOCK);
      if (mem == nullptr) return at::empty({static_cast<int64_t>(n)}, BYTES);
      block = std::make_shared<Block>(mem);
      current_ = block;
      used_ = 0;
    }
    void* at = static_cast<char*>(block->mem) + used_;
    used_ += (n + 63) / 64 * 64;
    return at::from_blob(at, {static_cast<int64_t>(n)}, [block](void*) {}, BYTES);
  }

 private:
  std::mutex mu_;
  std::weak_ptr<Block> current_;
  size_t used_ = 0;
};

}  // namespace

at::Tensor weights_memory(int64_t bytes) {
  const size_t n = static_cast<size_t>(bytes);
  void* mem = n >= static_cast<size_t>(HUGE_PAGE) ? huge_pages(n) : nullptr;
  if (mem != nullptr) return at::from_blob(mem, {bytes}, [](void* p) { std::free(p); }, BYTES);
  return at::empty({bytes}, BYTES);
}

at::Tensor lasting_memory(int64_t bytes) {
  static Arena arena;
  if (bytes >= HUGE_PAGE || bytes == 0) return weights_memory(bytes);
  return arena.take(static_cast<size_t>(bytes));
}

int64_t lasting_blocks() { return blocks_alive.load(); }

}  // namespace tfq

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) { m.def("lasting_blocks() -> int", tfq::lasting_blocks); }
