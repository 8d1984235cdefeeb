// tfq's linear layer on quantized weights (GGUF's Q4_0, Q5_0, Q8_0, Q4_K, Q6_K): y = x W^T + b where W is kept
// in its blocks, small integers and per-block scales, and each weight is unpacked to fp32 only in registers or
// in a panel-sized buffer.
//
// The arithmetic, and why it is exact: every GGUF weight of these formats is w = s * (q - zero) or
// w = s * q - m, where q is a small integer, s and m fp32 numbers built from the block's fp16 scales (products
// of an fp16 and a 6- or 8-bit integer: exact in fp32). tfq unpacks it as fma(float(q - zero), s, o) with o = m
// negated (Q4_K) or -0: one rounding of the exact value, which is what the gguf package's dequantization gives
// (its products are exact but for one rounding, so any order of them rounds to the same float). Then each
// output is summed by linear.cpp's recipe, acc = fma(x[k], w[k], acc) for k = 0 .. K - 1, then acc + bias. So
// a quantized layer gives, bit for bit, what the fp32 layer gives on the dequantized weights: row-invariant by
// the same construction, the same on AVX-512, AVX2 and plain C++, and at any thread count (threads split
// panels of outputs, never a sum). Activations stay fp32; nothing is quantized at run time.
//
// Layout (`qpack`): a segment is a 64-byte header, then panels of 64 outputs, as linear.cpp's fp32 panels are; a
// blob is one or more segments (`qcat`), their outputs one after another, each in its own format, so a layer
// of q (Q4_K), k (Q4_K) and v (Q6_K) keeps each at its width. A panel is K / G groups of G inputs (G = 32, or
// 16 for Q6_K, whose scales are per 16); a group is its scales, then G rows, one per input k, of the 64
// outputs' integers:
//   8 bits: 64 bytes, signed;
//   4, 5, 6 bits: 32 bytes of nibbles (byte i: output i low, output i + 32 high), then for 5 and 6 bits a
//   plane of bit 4 (8 bytes, bit n = output n), then for 6 bits a plane of bit 5.
// The scales: s [64] fp32, then o [64] fp32 (formats with offsets); or, for the K formats, in the file's two
// levels: the panel starts with each super block's d [64] (and dmin [64]) fp32, and a group holds sc [64]
// (and m [64]) as int8, s = d sc and o = -(dmin m) being exact products. So a Q4_K weight costs 4.75 bits
// (the file: 4.5), a Q6_K weight 6.625 (6.5625), a Q5_0 weight 6 (5.5).
//
// MLX's affine groups (tfq/model/mlx.py) are kept the same way, with their own rounding (`Header::rounding`):
// MLX computes w = round(round((q - zero) * s) + o) in its scales' dtype, so the unpacking is the product then
// the sum, each rounded, in fp32 (ROUND_FP32) or each rounded to bf16 (ROUND_BF16, by integer operations on
// the fp32 bits). (q - zero) * s is exact in fp32 for a bf16 scale, so each of the two roundings is MLX's.
// Again the unpacked value is the dequantized weight to the bit, and the sum the fp32 recipe.
//
// Speed: a decode step (a few rows) unpacks each weight vector once in registers and uses it for every row
// (`fused`); a prompt's forward unpacks a panel once into an fp32 buffer and runs linear.cpp's tiles over all
// its rows (`through_buffer`): the unpacking is then a small cost beside the products. Both are the recipe
// above, so which one runs never changes a bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "lanes.h"
#include "memory.h"
#include "ops.h"
#include "pool.h"
#include "panel.h"
#include "quant_blob.h"

namespace {

using tfq::V;
using tfq::vbroadcast;
using tfq::vfma;
using tfq::vstore;
using tfq::vzero;

constexpr int64_t PANEL = tfq::PANEL_OUTPUTS;
using tfq::blob::HEADER;
using tfq::blob::MAGIC;
constexpr int64_t FUSED_ROWS = 8;  // up to this many rows, weights are unpacked in registers; beyond, into a buffer
// How far ahead a register tile prefetches its stream, into L1 and L2 (bytes; one line each a row of the group).
// Without them the default model's 97 quantized layers at one row took 41-43 ms here instead of 23-27:
// unpacking keeps the cores busy, so memory must be asked for early.
constexpr int64_t AHEAD_L1 = 4096, AHEAD_L2 = 16384;
alignas(64) constexpr float NEG_ZERO[PANEL] = {
    -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f,
    -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f,
    -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f,
    -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f};

enum Rounding : int16_t { ROUND_FMA = 0, ROUND_FP32 = 1, ROUND_BF16 = 2 };  // GGUF's one rounding; MLX's two
using tfq::blob::SCALES_FP32;
using tfq::blob::SCALES_TWO_LEVEL;

using tfq::blob::Header;
using tfq::blob::Segment;
using tfq::blob::segment_bytes;
using tfq::blob::segments_of;

int16_t row_bytes(int64_t bits) { return bits == 8 ? 64 : bits == 4 ? 32 : bits == 5 ? 40 : 48; }

// Vector j (outputs 16j .. 16j + 15) of one row of a group: its integers q as fp32 (exact: |q| < 2^8)
template <int BITS>
inline V qfloat(const uint8_t* row, int j) {
#if defined(__AVX512F__)
  if (BITS == 8)
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j))))};
  // a nibble's float by a 16-entry table: the permute reads only each lane's low 4 bits, so the low nibble
  // needs no mask, and the table stands in for the conversion (one operation instead of two; the same floats)
  const __m512 table = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * (j & 1))));
  __m512 q = _mm512_permutexvar_ps(j < 2 ? b : _mm512_srli_epi32(b, 4), table);
  if (BITS >= 5) {  // the bit planes add 16 and 32 where set: exact in fp32
    uint16_t m;
    std::memcpy(&m, row + 32 + 2 * j, 2);
    q = _mm512_mask_add_ps(q, m, q, _mm512_set1_ps(16.f));
  }
  if (BITS == 6) {
    uint16_t m;
    std::memcpy(&m, row + 40 + 2 * j, 2);
    q = _mm512_mask_add_ps(q, m, q, _mm512_set1_ps(32.f));
  }
  return {q};
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 half[2];
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int h = 0; h < 2; h++) {
    __m256i q;
    if (BITS == 8) {
      q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * j + 8 * h)));
    } else {
      const __m256i b =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 16 * (j & 1) + 8 * h)));
      q = j < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(15)) : _mm256_srli_epi32(b, 4);
      if (BITS >= 5) {
        const __m256i bit = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(row[32 + 2 * j + h]), sel), sel);
        q = _mm256_add_epi32(q, _mm256_and_si256(bit, _mm256_set1_epi32(16)));
      }
      if (BITS == 6) {
        const __m256i bit = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(row[40 + 2 * j + h]), sel), sel);
        q = _mm256_add_epi32(q, _mm256_and_si256(bit, _mm256_set1_epi32(32)));
      }
    }
    half[h] = _mm256_cvtepi32_ps(q);
  }
  return {half[0], half[1]};
#else
  alignas(64) float f[16];
  for (int l = 0; l < 16; l++) {
    const int n = 16 * j + l;
    int32_t q;
    if (BITS == 8) {
      q = static_cast<int8_t>(row[n]);
    } else {
      q = n < 32 ? row[n] & 15 : row[n - 32] >> 4;
      if (BITS >= 5) q += ((row[32 + n / 8] >> (n % 8)) & 1) * 16;
      if (BITS == 6) q += ((row[40 + n / 8] >> (n % 8)) & 1) * 32;
    }
    f[l] = static_cast<float>(q);
  }
  return tfq::vload(f);
#endif
}

// A group's scales as vectors, with zero folded into the offset: o' = fma(-zero, s, o) is exact (zero is 0 or
// a power of two, and o is -0 when zero is not 0), so fma(float(q), s, o') is one rounding of
// (q - zero) s + o, the same value as fma(float(q - zero), s, o) (only a zero's sign may differ, which no sum
// that starts from +0 can see: fma(x, +-0, acc) is acc unless acc is -0, and acc never is)
// (MLX's roundings keep zero apart: q - zero is exact in fp32, and the product must round as MLX's does.)
struct Group {
  V s[4], o[4], zero;
  const uint8_t* rows;
};

template <int ROUND, int MODE>
inline Group group_at(const Header& h, const uint8_t* panel, int64_t g) {
  Group r;
  r.zero = vbroadcast(static_cast<float>(h.zero));
  if (MODE == SCALES_TWO_LEVEL) {  // s = d sc, o = -(dmin m): exact products, as the file's dequantization has them
    const float* d = reinterpret_cast<const float*>(panel + (g / h.super_groups) * 4 * PANEL * (1 + h.has_offset));
    const uint8_t* base = panel + h.super_bytes + g * h.group_bytes;
    for (int j = 0; j < 4; j++) {
      r.s[j] = tfq::vmul(tfq::vload(d + 16 * j), qfloat<8>(base, j));
      r.o[j] = h.has_offset ? tfq::vmul(tfq::vmul(tfq::vload(d + PANEL + 16 * j), qfloat<8>(base + PANEL, j)),
                                        vbroadcast(-1.f))
                            : tfq::vload(NEG_ZERO);
    }
    r.rows = base + PANEL * (1 + h.has_offset);
  } else {
    const uint8_t* base = panel + g * h.group_bytes;
    const float* s = reinterpret_cast<const float*>(base);
    const float* o = h.has_offset ? s + PANEL : NEG_ZERO;
    for (int j = 0; j < 4; j++) {
      r.s[j] = tfq::vload(s + 16 * j);
      r.o[j] = tfq::vload(o + 16 * j);
    }
    r.rows = base + 4 * PANEL * (1 + h.has_offset);
  }
  if (ROUND == ROUND_FMA)
    for (int j = 0; j < 4; j++) r.o[j] = vfma(vbroadcast(-static_cast<float>(h.zero)), r.s[j], r.o[j]);
  return r;
}

// Vector j of a group's row as fp32 weights, in the blob's rounding
template <int BITS, int ROUND>
inline V weights(const uint8_t* row, int j, const Group& sc) {
  if (ROUND == ROUND_FMA) return vfma(qfloat<BITS>(row, j), sc.s[j], sc.o[j]);
  const V product = tfq::vmul(tfq::vsub(qfloat<BITS>(row, j), sc.zero), sc.s[j]);
  if (ROUND == ROUND_FP32) return tfq::vadd(product, sc.o[j]);
  return tfq::vround_bf16(tfq::vadd(tfq::vround_bf16(product), sc.o[j]));
}

// The panel's fp32 weights for inputs [k0, k1) (whole groups), as linear.cpp's pack lays them out: [k1 - k0][64]
template <int BITS, int ROUND, int MODE>
void unpack_rows(const Header& h, const uint8_t* panel, int64_t k0, int64_t k1, float* out) {
  for (int64_t g = k0 / h.group; g < k1 / h.group; g++) {
    const Group grp = group_at<ROUND, MODE>(h, panel, g);
    for (int64_t r = 0; r < h.group; r++) {
      const uint8_t* row = grp.rows + r * h.row_bytes;
      TFQ_PREFETCH_L2(row + AHEAD_L2);
      float* dst = out + (g * h.group + r - k0) * PANEL;
      for (int j = 0; j < 4; j++) vstore(dst + 16 * j, weights<BITS, ROUND>(row, j, grp));
    }
  }
}

struct PanelBytes {
  const Header* h;
  const uint8_t* panel;
};

template <int BITS, int ROUND, int MODE>
void fill_block(const void* from, int64_t k0, int64_t k1, float* block) {
  const auto* p = static_cast<const PanelBytes*>(from);
  unpack_rows<BITS, ROUND, MODE>(*p->h, p->panel, k0, k1, block);
}

// rows [mr] x NV vectors of the panel's outputs, unpacking each weight vector once for all of them: NV = 4 is the
// whole panel (up to 4 rows: 16 accumulators); NV = 2 is half of it, vectors `half` and `half + 2`, which share
// their nibble bytes (5 to 8 rows: up to 16 accumulators, so the panel is read twice, from cache the second time,
// and each weight is still unpacked once). A row of y is N apart.
template <int BITS, int ROUND, int MODE, int mr, int NV>
void fused(const Header& h, const uint8_t* panel, const float* x, const float* bias, float* y, int64_t N,
           int64_t outputs, int half) {
  const int64_t K = h.k;
  V acc[mr][NV];
  for (int i = 0; i < mr; i++)
    for (int v = 0; v < NV; v++) acc[i][v] = vzero();
  for (int64_t g = 0; g < K / h.group; g++) {
    const Group grp = group_at<ROUND, MODE>(h, panel, g);
    for (int64_t r = 0; r < h.group; r++) {
      const uint8_t* row = grp.rows + r * h.row_bytes;
      const int64_t k = g * h.group + r;
      TFQ_PREFETCH(row + AHEAD_L1);
      TFQ_PREFETCH_L2(row + AHEAD_L2);
      for (int v = 0; v < NV; v++) {
        const int j = NV == 4 ? v : half + 2 * v;
        const V w = weights<BITS, ROUND>(row, j, grp);
        for (int i = 0; i < mr; i++) acc[i][v] = vfma(vbroadcast(x[i * K + k]), w, acc[i][v]);
      }
    }
  }
  alignas(64) float out[16];
  for (int i = 0; i < mr; i++)
    for (int v = 0; v < NV; v++) {
      const int64_t first = 16 * (NV == 4 ? v : half + 2 * v);
      vstore(out, acc[i][v]);
      for (int64_t n = first; n < std::min(outputs, first + 16); n++)
        y[i * N + n] = out[n - first] + (bias ? bias[n] : 0.f);
    }
}

template <int BITS, int ROUND, int MODE>
void fused_rows(const Header& h, const uint8_t* panel, const float* x, int64_t M, const float* bias, float* y,
                int64_t N, int64_t outputs) {
  if (M > 4) {
    for (int half = 0; half < 2; half++) {
      switch (M) {
        case 8: fused<BITS, ROUND, MODE, 8, 2>(h, panel, x, bias, y, N, outputs, half); break;
        case 7: fused<BITS, ROUND, MODE, 7, 2>(h, panel, x, bias, y, N, outputs, half); break;
        case 6: fused<BITS, ROUND, MODE, 6, 2>(h, panel, x, bias, y, N, outputs, half); break;
        default: fused<BITS, ROUND, MODE, 5, 2>(h, panel, x, bias, y, N, outputs, half); break;
      }
    }
    return;
  }
  switch (M) {
    case 4: fused<BITS, ROUND, MODE, 4, 4>(h, panel, x, bias, y, N, outputs, 0); break;
    case 3: fused<BITS, ROUND, MODE, 3, 4>(h, panel, x, bias, y, N, outputs, 0); break;
    case 2: fused<BITS, ROUND, MODE, 2, 4>(h, panel, x, bias, y, N, outputs, 0); break;
    default: fused<BITS, ROUND, MODE, 1, 4>(h, panel, x, bias, y, N, outputs, 0); break;
  }
}

// One panel of 64 outputs for all M rows: y and bias start at the panel's first output
template <int BITS, int ROUND, int MODE>
void panel_job(const Header& h, const uint8_t* panel, const float* x, int64_t M, const float* bias, float* y,
               int64_t N, int64_t outputs, std::vector<float>& buffer) {
  if (M <= FUSED_ROWS) {
    fused_rows<BITS, ROUND, MODE>(h, panel, x, M, bias, y, N, outputs);
    return;
  }
  if (M <= tfq::BLOCKED_ROWS && tfq::BLOCK_INPUTS % h.group == 0) {  // unpacked a block at a time, into L1
    const PanelBytes from{&h, panel};
    tfq::panel_rows_filled(x, M, h.k, &fill_block<BITS, ROUND, MODE>, &from, bias, y, N, outputs);
    return;
  }
  buffer.resize(static_cast<size_t>(h.k * PANEL));
  unpack_rows<BITS, ROUND, MODE>(h, panel, 0, h.k, buffer.data());
  tfq::panel_rows_fp32(x, M, h.k, buffer.data(), bias, y, N, outputs);
}

using PanelFn = void (*)(const Header&, const uint8_t*, const float*, int64_t, const float*, float*, int64_t, int64_t,
                         std::vector<float>&);

template <int ROUND, int MODE>
PanelFn with_bits(int bits) {
  switch (bits) {
    case 4: return &panel_job<4, ROUND, MODE>;
    case 5: return &panel_job<5, ROUND, MODE>;
    case 6: return &panel_job<6, ROUND, MODE>;
    default: return &panel_job<8, ROUND, MODE>;
  }
}

PanelFn panel_fn(const Header& h) {
  if (h.scale_mode == SCALES_TWO_LEVEL) return with_bits<ROUND_FMA, SCALES_TWO_LEVEL>(h.bits);  // GGUF's K formats
  switch (h.rounding) {
    case ROUND_FP32: return with_bits<ROUND_FP32, SCALES_FP32>(h.bits);
    case ROUND_BF16: return with_bits<ROUND_BF16, SCALES_FP32>(h.bits);
    default: return with_bits<ROUND_FMA, SCALES_FP32>(h.bits);
  }
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& blob, const c10::optional<at::Tensor>& b, int64_t N) {
  std::vector<Segment> segs = segments_of(blob);
  const int64_t n_total = segs.back().first + segs.back().h.n;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == segs[0].h.k && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tfq qlinear: x [M, K] fp32, contiguous");
  TORCH_CHECK(N == n_total, "tfq qlinear: N does not match the blob");
  TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == N),
              "tfq qlinear: bias [N] fp32");
  const int64_t M = x.size(0);
  auto y = tfq::pool::empty({M, N}, x.options());
  if (M == 0) return y;
  if (segs[0].h.magic == tfq::blob::MAGIC_Q8) {  // activations rounded to 8 bits (quant_q8.cpp)
    tfq::q8::linear(x, segs, b.has_value() ? b->data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
    return y;
  }
  tfq::quant::linear_many({{x.data_ptr<float>(), M, &segs, y.data_ptr<float>(), N,
                             b.has_value() ? b->data_ptr<float>() : nullptr}});
  return y;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// q [N, K] uint8 (the integers; for 8 bits, int8 bit patterns), s [N, K / G] fp32, o [N, K / G] fp32 or none;
// rounding: 0 GGUF's fma, 1 MLX's product and sum in fp32, 2 the same each rounded to bf16. With sd [N, K / SB]
// fp32 and sq [N, K / G] int8 (and od, oq for the offsets), the scales are kept in the file's two levels
// (s = sd sq, o = -(od oq), checked here bit for bit). One segment.
at::Tensor qpack(const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& o, int64_t bits,
                 int64_t group, int64_t zero, int64_t rounding, const c10::optional<at::Tensor>& sd,
                 const c10::optional<at::Tensor>& sq, const c10::optional<at::Tensor>& od,
                 const c10::optional<at::Tensor>& oq) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "tfq qpack: 4, 5, 6 or 8 bits");
  TORCH_CHECK(group == 16 || group == 32 || group == 64 || group == 128, "tfq qpack: groups of 16 to 128 inputs");
  TORCH_CHECK(rounding >= ROUND_FMA && rounding <= ROUND_BF16, "tfq qpack: rounding 0, 1 or 2");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) % group == 0,
              "tfq qpack: q [N, K] uint8 with K a multiple of the group");
  const int64_t N = q.size(0), K = q.size(1), groups = K / group;
  const auto sc = tfq::blob::checked_scales("tfq qpack", N, groups, s, o, sd, sq, od, oq);
  const bool two = sd.has_value();
  TORCH_CHECK(!two || rounding == ROUND_FMA, "tfq qpack: two-level scales are GGUF's, rounding 0");
  const int16_t off = o.has_value() ? 1 : 0;
  Header h{MAGIC, static_cast<int16_t>(bits), static_cast<int16_t>(rounding), static_cast<int32_t>(group),
           static_cast<int32_t>(zero), off, static_cast<int16_t>(two ? SCALES_TWO_LEVEL : SCALES_FP32),
           row_bytes(bits), static_cast<int16_t>(two ? groups / sc.supers : 0), N, K, (N + PANEL - 1) / PANEL,
           0, 0, 0};
  h.group_bytes = static_cast<int32_t>((two ? 1 : 4) * PANEL * (1 + off) + group * h.row_bytes);
  h.super_bytes = static_cast<int32_t>(two ? sc.supers * 4 * PANEL * (1 + off) : 0);
  h.panel_bytes = h.super_bytes + groups * h.group_bytes;
  auto blob = tfq::weights_memory(segment_bytes(h));
  uint8_t* out = blob.data_ptr<uint8_t>();
  std::memcpy(out, &h, sizeof h);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  std::atomic<bool> agree{true};
  at::parallel_for(0, h.panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
      uint8_t* panel = out + HEADER + p * h.panel_bytes;
      std::memset(panel, 0, static_cast<size_t>(h.panel_bytes));
      for (int64_t j = 0; j < PANEL; j++) {
        const int64_t n = p * PANEL + j;
        if (n >= N) continue;  // outputs past N: zero bytes, never stored by qlinear
        for (int64_t u = 0; u < sc.supers; u++) {
          float* d = reinterpret_cast<float*>(panel + u * 4 * PANEL * (1 + off));
          d[j] = sc.sd[n * sc.supers + u];
          if (off) d[PANEL + j] = sc.od[n * sc.supers + u];
        }
        for (int64_t g = 0; g < groups; g++) {
          uint8_t* base = panel + h.super_bytes + g * h.group_bytes;
          if (two) {
            const int64_t u = n * sc.supers + g / h.super_groups, i = n * groups + g;
            base[j] = static_cast<uint8_t>(sc.sq[i]);
            if (off) base[PANEL + j] = static_cast<uint8_t>(sc.oq[i]);
            if (!same_bits(sc.sd[u] * static_cast<float>(sc.sq[i]), sc.s[i]) ||
                (off && !same_bits(-(sc.od[u] * static_cast<float>(sc.oq[i])), sc.o[i])))
              agree = false;
          } else {
            float* gs = reinterpret_cast<float*>(base);
            gs[j] = sc.s[n * groups + g];
            if (sc.o) gs[PANEL + j] = sc.o[n * groups + g];
          }
          uint8_t* rows = base + (two ? 1 : 4) * PANEL * (1 + off);
          for (int64_t r = 0; r < group; r++) {
            const uint8_t v = qp[n * K + g * group + r];
            uint8_t* row = rows + r * h.row_bytes;
            if (bits == 8) {
              row[j] = v;
              continue;
            }
            row[j % 32] |= static_cast<uint8_t>((v & 15) << (j < 32 ? 0 : 4));
            if (bits >= 5) row[32 + j / 8] |= static_cast<uint8_t>(((v >> 4) & 1) << (j % 8));
            if (bits == 6) row[40 + j / 8] |= static_cast<uint8_t>(((v >> 5) & 1) << (j % 8));
          }
        }
      }
    }
  });
  TORCH_CHECK(agree.load(), "tfq qpack: the two-level scales do not multiply to s and o");
  return blob;
}

// Blobs stacked by outputs into the one a layer keeps (each keeps its segments and their formats), in
// lasting_memory: a lone blob that has pages of its own is kept as it is, a smaller one moves into a shared block
at::Tensor qcat(at::TensorList blobs) {
  TORCH_CHECK(!blobs.empty(), "tfq qcat: at least one blob");
  if (blobs.size() == 1 && blobs[0].numel() >= tfq::HUGE_PAGE) return blobs[0];
  int64_t total = 0, k = -1;
  for (const at::Tensor& b : blobs) {
    const auto segs = segments_of(b);
    TORCH_CHECK(k < 0 || segs[0].h.k == k, "tfq qcat: the blobs share their inputs");
    k = segs[0].h.k;
    total += b.numel();
  }
  auto blob = tfq::lasting_memory(total);
  uint8_t* out = blob.data_ptr<uint8_t>();
  for (const at::Tensor& b : blobs) {
    std::memcpy(out, b.data_ptr<uint8_t>(), static_cast<size_t>(b.numel()));
    out += b.numel();
  }
  return blob;
}

}  // namespace

at::Tensor tfq::ops::qlinear(const at::Tensor& x, const at::Tensor& blob, const c10::optional<at::Tensor>& b,
                             int64_t N) {
  return ::qlinear(x, blob, b, N);
}

namespace tfq::quant {

void linear_many(const std::vector<Product>& products) {
  struct Job {
    PanelFn fn;
    const Segment* seg;
    int64_t local;  // the panel's index in its segment
    const Product* product;
  };
  std::vector<Job> jobs;
  for (const Product& p : products) {
    for (const Segment& seg : *p.segs) {
      TORCH_CHECK(seg.h.magic == tfq::blob::MAGIC, "tfq linear_many: blobs of quant.cpp's layout");
      const PanelFn fn = panel_fn(seg.h);
      for (int64_t local = 0; local < seg.h.panels; local++) jobs.push_back({fn, &seg, local, &p});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t j0, int64_t j1) {
    thread_local std::vector<float> buffer;
    for (int64_t j = j0; j < j1; j++) {
      const Job& job = jobs[j];
      const Segment& seg = *job.seg;
      const Product& p = *job.product;
      const int64_t out = seg.first + job.local * PANEL;
      job.fn(seg.h, seg.panels + job.local * seg.h.panel_bytes, p.x, p.M, p.bias ? p.bias + out : nullptr,
             p.y + out, p.N, std::min(PANEL, seg.h.n - job.local * PANEL), buffer);
    }
  });
}

}  // namespace tfq::quant

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("qpack(Tensor q, Tensor s, Tensor? o, int bits, int group, int zero, int rounding=0, Tensor? sd=None, "
        "Tensor? sq=None, Tensor? od=None, Tensor? oq=None) -> Tensor");
  m.def("qcat(Tensor[] blobs) -> Tensor");
  m.def("qlinear(Tensor x, Tensor blob, Tensor? b, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("qpack", qpack);
  m.impl("qcat", qcat);
  m.impl("qlinear", qlinear);
}
