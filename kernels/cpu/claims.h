// Work handed to threads as they come free, in runs that shrink toward the end (guided scheduling). A run is a
// stream the prefetches must start again, so runs are long while much is left; near the end they shrink to a
// single item, so no thread idles for long while another finishes a long run (quant_q8.cpp says what that cost).
// Which thread computes an item never changes its bits.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

namespace tfq {

class Claims {
 public:
  // items [0, items), runs of at most `most`, and never more than a share of what is left among `threads`
  Claims(int64_t items, int64_t most, int64_t threads)
      : items_(items), most_(std::max<int64_t>(1, most)), share_(2 * std::max<int64_t>(1, threads)) {}

  // The next run [first, last); first == last when nothing is left.
  std::pair<int64_t, int64_t> next() {
    int64_t first = next_.load(std::memory_order_relaxed), take = 0;
    do {
      if (first >= items_) return {items_, items_};
      take = std::clamp<int64_t>((items_ - first) / share_, 1, most_);
    } while (!next_.compare_exchange_weak(first, first + take, std::memory_order_relaxed));
    return {first, first + take};
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t items_, most_, share_;
};

}  // namespace tfq
