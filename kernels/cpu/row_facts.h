// What a draw reads of a logits row, taken where the model's one object has just written the row with its head
// (layer.cpp): whether every value is finite, and its first largest (the lowest index holding the maximum, as
// numpy's argmax gives it). The engine's check and greedy draw take them (tfq/engine/core.py) instead of reading
// the row again in numpy: the first reader of a row the head's threads wrote, on code a forward left cold, took
// 100-130 us of a one-lane decode step. Exact by construction: a comparison and a maximum round nothing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lanes.h"

namespace tfq {

struct RowFacts {
  bool finite;
  int64_t first;  // -1 where a value is not finite
};

inline RowFacts row_facts(const float* x, int64_t n) {
  constexpr int64_t BLOCK = 1024;  // the first largest is looked for only in the first block that holds the maximum
  V bad = vzero();  // v - v: +0 where v is finite, NaN where it is an infinity or NaN; summed, NaN if any was
  bool tail_finite = true;
  float top = 0.f;
  int64_t top_block = -1;
  for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
    const int64_t b1 = std::min(n, b0 + BLOCK);
    int64_t j = b0;
    float m = -INFINITY;
    if (b1 - b0 >= 16) {
      V vm = vload(x + b0);
      for (; j + 16 <= b1; j += 16) {
        const V v = vload(x + j);
        vm = vmax(v, vm);
        bad = vadd(bad, vsub(v, v));
      }
      alignas(64) float lanes[16];
      vstore(lanes, vm);
      for (const float l : lanes) m = l > m ? l : m;
    }
    for (; j < b1; j++) {
      m = x[j] > m ? x[j] : m;
      tail_finite = tail_finite && std::isfinite(x[j]);
    }
    if (top_block < 0 || m > top) top = m, top_block = b0;
  }
  alignas(64) float lanes[16];
  vstore(lanes, bad);
  bool finite = tail_finite && n > 0;
  for (const float l : lanes) finite = finite && l == 0.f;
  if (!finite) return {false, -1};
  for (int64_t j = top_block; j < n; j++)
    if (x[j] == top) return {true, j};
  return {false, -1};  // unreachable: the block's maximum is one of its values
}

}  // namespace tfq
