// tfq's attention on the CPU: one query row over its own keys in the cache, in the arithmetic of
// docs/contract.md (tiles of KEY_TILE keys, online softmax in fp32; `partial` restarts at every split and merges
// the splits in order), each (query row, KV head) computed by one thread in one fixed order.
//
// What a row's bits depend on: its query, its keys and values (read through its own table of cache rows), its
// length, the scale and the arithmetic. Not on the other rows of the call, whether the row came from a decode
// step, a prompt chunk or a draft verify, where its keys sit (a lane or pages), or the thread count. So a row
// is the same everywhere by construction (the start-up guard still proves it on the running build).
//
// The recipe, for one query head (q scaled first: q_d * scale, one rounding):
//   score of key j:  s_j = sum over d = 0..D-1, in order, of fma(q_d, k_jd, s)   (from 0)
//   per tile: m' = max(m, max_j s_j); p_j = exp(s_j - m'); a = exp(m - m')        (exp: ours, below)
//             t   = sum over the tile's keys j in order of p_j, as 16 lanes (lane j mod 16) then a fixed tree
//             o_d = sum over the tile's keys j in order of fma(p_j, v_jd, o_d)    (from 0)
//             l = fma(l, a, t); acc_d = fma(acc_d, a, o_d); m = m'
//   rows: out_d = acc_d / l.
//   partial: the same per split of SPLIT keys from a fresh state (m = -inf, l = acc = 0); then, splits in
//            order, with M the largest m: w = exp(m_s - M), L = fma(l_s, w, L), A_d = fma(acc_d, w, A_d);
//            out_d = A_d / L.
// exp is a fixed polynomial (Cephes' expf coefficients) written once over 16 lanes, so the vector and the
// scalar uses round alike on every instruction set; an argument below -87 gives 0 (the result would be a
// denormal, where instruction sets round differently).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "lanes.h"
#include "ops.h"
#include "pool.h"

namespace {

using tfq::V;
using tfq::vzero;
using tfq::vload;
using tfq::vstore;
using tfq::vfma;
using tfq::exp1;
using tfq::reduce;

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }

// 16 rows of 16 floats (rows[i] points at row i) -> out[d * stride + i]: a tile's keys turned so that lanes run
// across keys. Moving data rounds nothing, so every path here gives the same kt.
inline void transpose16(const float* const* rows, float* out, int64_t stride) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows[i]);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved: t[i] = a0 b0 a1 b1 | a4 b4 a5 b5 | ...
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads: each 128-bit lane holds one column of 4 rows
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {  // 128-bit lanes gathered across the quads
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; i++) _mm512_storeu_ps(out + i * stride, r[i]);  // r[i] is column i
#else
  for (int d = 0; d < 16; d++)
    for (int i = 0; i < 16; i++) out[d * stride + i] = rows[i][d];
#endif
}

// Scores of 16 keys at a time (lanes across keys), each key's sum over d in order from 0; four groups of keys
// run side by side so that four independent chains hide the latency of a fused multiply-add (the order of
// each key's sum is unchanged).
inline void scores(const float* qg, const float* kt, int64_t tile, int64_t lanes, int64_t D, float* s) {
  int64_t j = 0;
  for (; j + 64 <= lanes; j += 64) {
    V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t d = 0; d < D; d++) {
      const V q = tfq::vbroadcast(qg[d]);
      const float* kd = kt + d * tile + j;
      a0 = vfma(q, vload(kd), a0);
      a1 = vfma(q, vload(kd + 16), a1);
      a2 = vfma(q, vload(kd + 32), a2);
      a3 = vfma(q, vload(kd + 48), a3);
    }
    vstore(s + j, a0);
    vstore(s + j + 16, a1);
    vstore(s + j + 32, a2);
    vstore(s + j + 48, a3);
  }
  for (; j < lanes; j += 16) {
    V a = vzero();
    for (int64_t d = 0; d < D; d++) a = vfma(tfq::vbroadcast(qg[d]), vload(kt + d * tile + j), a);
    vstore(s + j, a);
  }
}

// o_d = sum over the tile's keys j in order of fma(p_j, v_jd, o_d), from 0; `values[j]` is key j's value row.
// With DV = D / 16 known, o stays in registers.
template <int DV>
inline void weigh_values(const float* p, int64_t cnt, const float* const* values, float* o) {
  V acc[DV];
  for (int v = 0; v < DV; v++) acc[v] = vzero();
  for (int64_t j = 0; j < cnt; j++) {
    const V pj = tfq::vbroadcast(p[j]);
    for (int v = 0; v < DV; v++) acc[v] = vfma(pj, vload(values[j] + 16 * v), acc[v]);
  }
  for (int v = 0; v < DV; v++) vstore(o + 16 * v, acc[v]);
}

inline void weigh_values(const float* p, int64_t cnt, const float* const* values, int64_t D, float* o) {
  switch (D) {
    case 64: weigh_values<4>(p, cnt, values, o); return;
    case 128: weigh_values<8>(p, cnt, values, o); return;
    default: break;
  }
  std::fill(o, o + D, 0.0f);
  for (int64_t j = 0; j < cnt; j++)
    for (int64_t d = 0; d < D; d += 16)
      vstore(o + d, vfma(tfq::vbroadcast(p[j]), vload(values[j] + d), vload(o + d)));
}

// A block of query rows that share one table of keys (consecutive rows of a prompt chunk or a verify, row r
// attending to lengths[r] keys), for one KV head and its `group` query heads. Each tile of keys is read once
// for the whole block; every row then runs exactly its own recipe on it (a key past a row's end scores -inf,
// and the lanes it adds to the tile's sum are exact zeros), so a row's bits are those it gets alone.
template <typename T>
void attend_block(const float* q, int64_t rows, int64_t q_stride, int64_t group, int64_t D, const T* kc,
                  const T* vc, int64_t row_stride, const int64_t* table, const int64_t* lengths, float scale,
                  int64_t tile, int64_t split, float* out, std::vector<float>& work,
                  std::vector<const float*>& values) {
  const int64_t G = group, RG = rows * group;
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; r++) longest = std::max(longest, lengths[r]);
  const int64_t per_split = split > 0 ? split : longest;
  const int64_t splits = (longest + per_split - 1) / per_split;
  // work: qs [RG][D], kt [D][tile], vt [tile][D], kw [16][D], zeros [16], s, p [tile], o [D],
  // per split: m, l [RG], acc [RG][D]
  const size_t need = RG * D + 2 * D * tile + 16 * D + 16 + 2 * tile + D + splits * RG * (2 + D) + 32;
  if (work.size() < need) work.resize(need);
  if (values.size() < static_cast<size_t>(tile)) values.resize(tile);
  const float** vrows = values.data();
  float* qs = work.data();
  float* kt = qs + RG * D;
  float* vt = kt + D * tile;
  float* kw = vt + tile * D;
  float* zeros = kw + 16 * D;
  std::fill(zeros, zeros + 16, 0.0f);
  float* s = zeros + 16;
  float* p = s + tile;
  float* o = p + tile;
  float* sm = o + D;                  // [splits][RG]
  float* sl = sm + splits * RG;       // [splits][RG]
  float* sacc = sl + splits * RG;     // [splits][RG][D]
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = 0; i < G * D; i++) qs[r * G * D + i] = q[r * q_stride + i] * scale;

  for (int64_t sp = 0; sp < splits; sp++) {
    const int64_t begin = sp * per_split;
    float* m = sm + sp * RG;
    float* l = sl + sp * RG;
    float* acc = sacc + sp * RG * D;
    std::fill(m, m + RG, NEG_INF);
    std::fill(l, l + RG, 0.0f);
    std::fill(acc, acc + RG * D, 0.0f);
    const int64_t block_end = std::min(longest, begin + per_split);
    for (int64_t j0 = begin; j0 < block_end; j0 += tile) {
      const int64_t loaded = std::min(tile, block_end - j0);
      const int64_t lanes = (loaded + 15) / 16 * 16;
      for (int64_t j = 0; j < loaded; j++) {  // the tile's values, widened to fp32 (fp32 is read where it is)
        const T* vr = vc + table[j0 + j] * row_stride;
        if constexpr (std::is_same_v<T, float>) {
          vrows[j] = vr;
        } else {
          for (int64_t d = 0; d < D; d++) vt[j * D + d] = widen(vr[d]);
          vrows[j] = vt + j * D;
        }
      }
      for (int64_t j = 0; j < lanes; j += 16) {  // the tile's keys, transposed 16 x 16 at a time (missing keys 0)
        const float* krows[16];
        for (int64_t i = 0; i < 16; i++) {
          if (j + i >= loaded) {
            krows[i] = zeros;
          } else if constexpr (std::is_same_v<T, float>) {
            krows[i] = kc + table[j0 + j + i] * row_stride;
          } else {  // widened into the value buffer's spare rows first
            const T* kr = kc + table[j0 + j + i] * row_stride;
            float* wide = kw + i * D;
            for (int64_t d = 0; d < D; d++) wide[d] = widen(kr[d]);
            krows[i] = wide;
          }
        }
        for (int64_t d = 0; d < D; d += 16) {
          const float* part[16];
          for (int i = 0; i < 16; i++) part[i] = krows[i] + (krows[i] == zeros ? 0 : d);
          transpose16(part, kt + d * tile + j, tile);
        }
      }
      for (int64_t r = 0; r < rows; r++) {
        const int64_t end = std::min(lengths[r], begin + per_split);
        if (j0 >= end) continue;  // past this row's keys (in this split): its state stays as it is
        const int64_t cnt = std::min(tile, end - j0);
        for (int64_t g = 0; g < G; g++) {
          const int64_t rg = r * G + g;
          const float* qg = qs + rg * D;
          scores(qg, kt, tile, lanes, D, s);
          for (int64_t j = cnt; j < lanes; j++) s[j] = NEG_INF;
          // the largest score, as 16 lanes then across them: a max is exact in any order (but for a zero's
          // sign, which the exp of a difference never sees)
          V tops = tfq::vbroadcast(NEG_INF);
          for (int64_t j = 0; j < lanes; j += 16) tops = tfq::vmax(vload(s + j), tops);
          alignas(64) float lane_tops[16];
          vstore(lane_tops, tops);
          float top = NEG_INF;
          for (int i = 0; i < 16; i++) top = std::max(top, lane_tops[i]);
          const float mn = std::max(m[rg], top);
          const V shift = tfq::vbroadcast(mn);
          for (int64_t j = 0; j < lanes; j += 16) vstore(p + j, tfq::vexp(tfq::vsub(vload(s + j), shift)));
          const float a = exp1(m[rg] - mn);  // m = -inf: a = 0
          const int64_t own = (cnt + 15) / 16 * 16;  // the row's own lanes: the sum's vectors, as alone
          V tv = vzero();
          for (int64_t j = 0; j < own; j += 16) tv = tfq::vadd(tv, vload(p + j));
          const float t = reduce(tv);
          weigh_values(p, cnt, vrows, D, o);
          float* ag = acc + rg * D;
          for (int64_t d = 0; d < D; d += 16) vstore(ag + d, vfma(vload(ag + d), tfq::vbroadcast(a), vload(o + d)));
          l[rg] = tfq::fma1(l[rg], a, t);
          m[rg] = mn;
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    const int64_t own_splits = (lengths[r] + per_split - 1) / per_split;
    for (int64_t g = 0; g < G; g++) {
      const int64_t rg = r * G + g;
      float* og = out + r * q_stride + g * D;
      if (split <= 0) {
        for (int64_t d = 0; d < D; d++) og[d] = sacc[rg * D + d] / sl[rg];
        continue;
      }
      float big = NEG_INF;
      for (int64_t sp = 0; sp < own_splits; sp++) big = std::max(big, sm[sp * RG + rg]);
      float L = 0.0f;
      std::fill(o, o + D, 0.0f);
      for (int64_t sp = 0; sp < own_splits; sp++) {
        const float w = exp1(sm[sp * RG + rg] - big);
        L = tfq::fma1(sl[sp * RG + rg], w, L);
        const float* as = sacc + (sp * RG + rg) * D;
        for (int64_t d = 0; d < D; d += 16) vstore(o + d, vfma(vload(as + d), tfq::vbroadcast(w), vload(o + d)));
      }
      for (int64_t d = 0; d < D; d++) og[d] = o[d] / L;
    }
  }
}

constexpr int64_t BLOCK_ROWS = 16;  // rows of one chunk that share the reading of a tile of keys

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                const at::Tensor& offsets, const at::Tensor& lengths, double scale, int64_t tile, int64_t split,
                at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = kc.size(1);
  const int64_t G = H / Hkv;
  const float* qp = q.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(kc.data_ptr());
  const T* vp = reinterpret_cast<const T*>(vc.data_ptr());
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* outp = out.data_ptr<float>();
  // blocks: runs of consecutive rows on one table (a chunk's rows), at most BLOCK_ROWS each
  std::vector<int64_t> starts;
  for (int64_t n = 0; n < N; n++)
    if (n == 0 || op[n] != op[n - 1] || n - starts.back() >= BLOCK_ROWS) starts.push_back(n);
  starts.push_back(N);
  const int64_t blocks = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, blocks * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> work;
    std::vector<const float*> values;
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / Hkv, h = i % Hkv, n0 = starts[b], rows = starts[b + 1] - n0;
      attend_block<T>(qp + (n0 * H + h * G) * D, rows, H * D, G, D, kp + h * D, vp + h * D, Hkv * D, tp + op[n0],
                      lp + n0, static_cast<float>(scale), tile, split, outp + (n0 * H + h * G) * D, work,
                      values);
    }
  });
}

// What the kernel reads keys through, checked once a call: every entry of the key table a cache row (whole, so a
// page-accounting bug anywhere in it is an error), and each row's span of it, table[offsets[n] : offsets[n] +
// lengths[n]], inside the table. The rows of a block share their offset, so the block reads inside it too. A row
// attends to one key at least, its own (a block of rows with none divided by zero splits).
void check_keys(int64_t N, int64_t cache_rows, const at::Tensor& table, const at::Tensor& offsets,
                const at::Tensor& lengths) {
  const int64_t T = table.numel();
  tfq::checks::indices("tfq attend", "table", table, T, cache_rows, "cache rows");
  const int64_t* op = tfq::checks::int64s("tfq attend", "offsets", offsets, N);
  const int64_t* lp = tfq::checks::int64s("tfq attend", "lengths", lengths, N);
  for (int64_t n = 0; n < N; n++) {
    TORCH_CHECK(lp[n] >= 1, "tfq attend: row ", n, " attends to ", lp[n], " keys, not one at least");
    TORCH_CHECK(op[n] >= 0 && op[n] <= T - lp[n], "tfq attend: row ", n, "'s keys table[", op[n], " : ", op[n], " + ",
                lp[n], "] are outside its table of ", T);
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& table, const at::Tensor& offsets, const at::Tensor& lengths, double scale,
                  int64_t tile, int64_t split) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "tfq attend: q [N, H, D] fp32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == v_cache.scalar_type(), "tfq attend: caches [R, Hkv, D], one dtype");
  TORCH_CHECK(q.size(2) % 16 == 0 && tile > 0 && tile % 16 == 0, "tfq attend: D and the tile must be multiples of 16");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              "tfq attend: query heads must be a multiple of KV heads");
  TORCH_CHECK(split == 0 || split % tile == 0, "tfq attend: a split must be whole tiles");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "tfq attend: v_cache ", v_cache.sizes(), " is not shaped as k_cache ",
              k_cache.sizes());
  TORCH_CHECK(q.size(2) == k_cache.size(2), "tfq attend: queries' head_dim ", q.size(2), ", the cache's ",
              k_cache.size(2));
  check_keys(q.size(0), k_cache.size(0), table, offsets, lengths);
  auto out = tfq::pool::empty_like(q);
  if (q.size(0) == 0) return out;
  switch (k_cache.scalar_type()) {
    case at::kFloat: attend_all<float>(q, k_cache, v_cache, table, offsets, lengths, scale, tile, split, out); break;
    case at::kBFloat16: attend_all<c10::BFloat16>(q, k_cache, v_cache, table, offsets, lengths, scale, tile, split, out); break;
    case at::kHalf: attend_all<c10::Half>(q, k_cache, v_cache, table, offsets, lengths, scale, tile, split, out); break;
    case at::kFloat8_e4m3fn: attend_all<c10::Float8_e4m3fn>(q, k_cache, v_cache, table, offsets, lengths, scale, tile, split, out); break;
    default: TORCH_CHECK(false, "tfq attend: cache dtype ", k_cache.scalar_type(), " is not one of fp32, bf16, fp16, fp8");
  }
  return out;
}

}  // namespace

at::Tensor tfq::ops::attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& table, const at::Tensor& offsets, const at::Tensor& lengths,
                            double scale, int64_t tile, int64_t split) {
  return ::attend(q, k_cache, v_cache, table, offsets, lengths, scale, tile, split);
}

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("attend(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, Tensor offsets, Tensor lengths, float scale, "
        "int tile, int split) -> Tensor");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("attend", attend);
}
