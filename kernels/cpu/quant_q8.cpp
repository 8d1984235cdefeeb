// tfq's linear layer on quantized weights with activations rounded to 8 bits (`weights: gguf-q8`): llama.cpp's
// kind of arithmetic, integer dot products, written as one recipe that is exact by tfq's rule.
//
// The recipe, for one row x and one output n:
//   1. x is rounded per block of 32 inputs: amax = max |x_k|, d = amax / 127, q_k = round(x_k * (127 / amax))
//      (to nearest, ties to even; in [-127, 127]). A block whose amax is below 2^-100 is zero (d = 0); one with a
//      NaN or an infinity has d = NaN. Each operation rounds once, in this order, on every path.
//   2. For each group of G weights (w = s (q - zero) + o, as quant.cpp keeps them): the integer
//      i = sum_k (q_w,k - zero) q_x,k, exact in int32 whatever the order, and b = sum_k q_x,k.
//   3. t = s * float(i), then, with offsets, t = t + o * float(b); acc = acc + d * t, groups in input order,
//      acc starting at +0; then y = acc + bias. Separate multiplies and adds, each rounding once (no fma).
// The integers are exact, so how they are summed (VNNI's four-byte dot products, AVX2's pairs, plain C++) never
// matters; the floats are one fixed sequence per output. So a row's result does not depend on the other rows,
// the thread count, or the instruction set: exact by construction, as the fp32 recipe is. It is another
// arithmetic than `weights: gguf` (whose bits are the dequantized model's): the activations lose bits here.
//
// Layout: a segment (quant_blob.h) of panels of 16 outputs. A panel holds, for the K formats, each super block's
// d [16] fp32 (and -dmin [16]); then its groups: scales (sc [16] int8, and m [16] int8; or s [16] fp32, and
// o [16] fp32), then the integers in chunks of 64 bytes, 16 lanes of 4 bytes, lane n for output n:
//   4, 5, 6 bits: a chunk covers 8 inputs: byte 4n + j holds input 8c + j in its low nibble and 8c + 4 + j in its
//     high one; 5 and 6 bits add one 64-byte plane of the high bits a group (5 bits, groups of 32: bit c of byte
//     4n + j is input 8c + j's bit 4, bit 4 + c input 8c + 4 + j's; 6 bits, groups of 16: bits 2c, 2c + 1 are
//     input 8c + j's bits 4 and 5, bits 4 + 2c, 5 + 2c input 8c + 4 + j's);
//   8 bits: a chunk covers 4 inputs, q + 128 as unsigned bytes (the zero is raised by 128).
// So a lane's four bytes are four consecutive inputs: one VNNI instruction takes 64 products.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cfloat>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "claims.h"
#include "lanes.h"
#include "memory.h"
#include "pool.h"
#include "panel.h"
#include "quant_blob.h"

namespace tfq::q8 {

using blob::Header;
using blob::Segment;
using tfq::V;

constexpr int64_t OUT = 16;    // outputs a panel
constexpr int64_t BLOCK = 32;  // inputs sharing an activation scale
constexpr float TINY = 7.8886091e-31f;  // 2^-100: a block below it is zero
// Bytes a tile prefetches ahead of its stream, into L1 and into L2: a hint, never the bits. How far pays depends
// on the core: near (384, 2,048) on a 2-core Zen 4 (AMD's family 25), where 1,536 into L1 halved a large matrix's
// rate; far (4,096, 8,192) on a 2-core Xeon VM with AVX-512 and AMX, 11-26% faster in every format there, and on a
// 2-core Zen 5 (family 26), 1.2 times the near pair's pace at one row and 1.4 times at four. Measured on those
// three machines only (docs/quantized.md); other Intel cores and later AMD families take the far pair untested,
// earlier AMD families the near one. `q8_prefetch` sets a pair for the process (benchmarks/linear_shapes.py
// --prefetch). Atomics: a benchmark may set it while a kernel runs.
namespace {
std::atomic<int64_t> reach_l1{384}, reach_l2{2048};
[[maybe_unused]] const bool reach_chosen = [] {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // needed before __builtin_cpu_is during static initialisation
  unsigned a = 0, b = 0, c = 0, d = 0, family = 0;
  if (__get_cpuid(1, &a, &b, &c, &d)) family = ((a >> 8) & 0xF) == 0xF ? 0xF + ((a >> 20) & 0xFF) : (a >> 8) & 0xF;
  if (__builtin_cpu_is("intel") || (__builtin_cpu_is("amd") && family >= 26)) reach_l1 = 4096, reach_l2 = 8192;
#endif
  return true;
}();
}  // namespace
constexpr int64_t CHUNK = 32;  // panels a thread takes at a time (fewer for a small layer)
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int TILE = 8;  // rows a tile: each of them an int32 and an fp32 accumulator
#else
constexpr int TILE = 4;
#endif

// 64 bytes of weights (16 lanes of 4) and 16 int32 lanes, on each instruction set
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct B { __m512i a; };
inline B bload(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline B band(B x, uint8_t m) { return {_mm512_and_si512(x.a, _mm512_set1_epi8(static_cast<char>(m)))}; }
inline B bor(B x, B y) { return {_mm512_or_si512(x.a, y.a)}; }
// shifts by 16-bit units: callers mask the result so that only the byte's own bits remain
inline B bshl(B x, int s) { return {_mm512_sll_epi16(x.a, _mm_cvtsi32_si128(s))}; }
inline B bshr(B x, int s) { return {_mm512_srl_epi16(x.a, _mm_cvtsi32_si128(s))}; }
struct I { __m512i a; };
inline I izero() { return {_mm512_setzero_si512()}; }
// acc + sum over each lane's 4 bytes of w (unsigned) times the 4 bytes at p (signed); `wide`: w may exceed 127
template <bool wide>
inline I idot(I acc, B w, const int8_t* p) {
  int32_t x4;
  std::memcpy(&x4, p, 4);
  const __m512i x = _mm512_set1_epi32(x4);
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.a, w.a, x)};
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if (wide) {  // pairs of 255 * 127 would saturate int16: w = (w & 127) + 128 (w >> 7), each part apart
    const __m512i low = _mm512_and_si512(w.a, _mm512_set1_epi8(0x7F));
    const __m512i top = _mm512_and_si512(_mm512_srli_epi16(w.a, 7), _mm512_set1_epi8(1));
    const __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(low, x), ones);
    const __m512i t = _mm512_madd_epi16(_mm512_maddubs_epi16(top, x), ones);
    return {_mm512_add_epi32(acc.a, _mm512_add_epi32(p, _mm512_slli_epi32(t, 7)))};
  }
  return {_mm512_add_epi32(acc.a, _mm512_madd_epi16(_mm512_maddubs_epi16(w.a, x), ones))};
#endif
}
inline I iset(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline V tofloat(I v) { return {_mm512_cvtepi32_ps(v.a)}; }
#elif defined(__AVX2__)
struct B { __m256i lo, hi; };
inline B bload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline B band(B x, uint8_t m) {
  const __m256i v = _mm256_set1_epi8(static_cast<char>(m));
  return {_mm256_and_si256(x.lo, v), _mm256_and_si256(x.hi, v)};
}
inline B bor(B x, B y) { return {_mm256_or_si256(x.lo, y.lo), _mm256_or_si256(x.hi, y.hi)}; }
inline B bshl(B x, int s) {
  const __m128i c = _mm_cvtsi32_si128(s);
  return {_mm256_sll_epi16(x.lo, c), _mm256_sll_epi16(x.hi, c)};
}
inline B bshr(B x, int s) {
  const __m128i c = _mm_cvtsi32_si128(s);
  return {_mm256_srl_epi16(x.lo, c), _mm256_srl_epi16(x.hi, c)};
}
struct I { __m256i lo, hi; };
inline I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline __m256i dot_half(__m256i acc, __m256i w, __m256i x, bool wide) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (!wide) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  // pairs of 255 * 127 would saturate int16: w = (w & 127) + 128 (w >> 7), each part apart
  const __m256i low = _mm256_and_si256(w, _mm256_set1_epi8(0x7F));
  const __m256i top = _mm256_and_si256(_mm256_srli_epi16(w, 7), _mm256_set1_epi8(1));
  const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(low, x), ones);
  const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(top, x), ones);
  return _mm256_add_epi32(acc, _mm256_add_epi32(p, _mm256_slli_epi32(t, 7)));
}
template <bool wide>
inline I idot(I acc, B w, const int8_t* p) {
  int32_t x4;
  std::memcpy(&x4, p, 4);
  const __m256i x = _mm256_set1_epi32(x4);
  return {dot_half(acc.lo, w.lo, x, wide), dot_half(acc.hi, w.hi, x, wide)};
}
inline I iset(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline V tofloat(I v) {
  alignas(64) float f[16];
  _mm256_storeu_ps(f, _mm256_cvtepi32_ps(v.lo));
  _mm256_storeu_ps(f + 8, _mm256_cvtepi32_ps(v.hi));
  return tfq::vload(f);
}
#else
struct B { uint8_t b[64]; };
inline B bload(const uint8_t* p) { B r; std::memcpy(r.b, p, 64); return r; }
inline B band(B x, uint8_t m) { for (auto& v : x.b) v &= m; return x; }
inline B bor(B x, B y) { for (int i = 0; i < 64; i++) x.b[i] |= y.b[i]; return x; }
inline B bshl(B x, int s) {  // by 16-bit units, as the vector paths (little-endian pairs of bytes)
  for (int i = 0; i < 64; i += 2) {
    uint16_t v = static_cast<uint16_t>(x.b[i] | (x.b[i + 1] << 8));
    v = static_cast<uint16_t>(v << s);
    x.b[i] = static_cast<uint8_t>(v), x.b[i + 1] = static_cast<uint8_t>(v >> 8);
  }
  return x;
}
inline B bshr(B x, int s) {
  for (int i = 0; i < 64; i += 2) {
    uint16_t v = static_cast<uint16_t>(x.b[i] | (x.b[i + 1] << 8));
    v = static_cast<uint16_t>(v >> s);
    x.b[i] = static_cast<uint8_t>(v), x.b[i + 1] = static_cast<uint8_t>(v >> 8);
  }
  return x;
}
struct I { int32_t v[16]; };
inline I izero() { I r; for (auto& v : r.v) v = 0; return r; }
template <bool wide>
inline I idot(I acc, B w, const int8_t* x) {
  for (int l = 0; l < 16; l++)
    for (int j = 0; j < 4; j++) acc.v[l] += static_cast<int32_t>(w.b[4 * l + j]) * x[j];
  return acc;
}
inline I iset(int32_t v) {
  I r;
  for (auto& l : r.v) l = v;
  return r;
}
inline V tofloat(I v) {
  alignas(64) float f[16];
  for (int l = 0; l < 16; l++) f[l] = static_cast<float>(v.v[l]);
  return tfq::vload(f);
}
#endif

// 16 int8 numbers as fp32 (exact)
inline V int8s(const uint8_t* p) {
#if defined(__AVX512F__)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
#elif defined(__AVX2__) && defined(__FMA__)
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
#else
  alignas(64) float f[16];
  for (int l = 0; l < 16; l++) f[l] = static_cast<float>(static_cast<int8_t>(p[l]));
  return tfq::vload(f);
#endif
}

// The activations rounded (step 1): q [M, K] int8, d [M, K / 32] fp32, and the sums of q by 16 and by 32, as
// int32 and as fp32 (exact: |sum| <= 32 * 127), the latter for a tile to multiply straight from memory
struct Rounded {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sums16, sums32;
  std::vector<float> fsums16, fsums32;
};

// One block of 32 (step 1): its q, the sums of its halves' q (sums[0], sums[1]), and its d as the function's value. Vectors where the build has AVX-512: the
// same operations, each rounding once (max is exact, one division each for d and 1 / d's factor, one product a
// lane, rounded to nearest even), so the same bits as the loop below.
inline float round_block(const float* xb, int8_t* qb, int32_t* sums) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
  const __m512 a = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
  const __m512 top = _mm512_set1_ps(FLT_MAX);
  // ordered compares: a NaN lane is not <= FLT_MAX
  if (_mm512_cmp_ps_mask(_mm512_abs_ps(lo), top, _CMP_LE_OQ) != 0xFFFF ||
      _mm512_cmp_ps_mask(_mm512_abs_ps(hi), top, _CMP_LE_OQ) != 0xFFFF) {
    std::memset(qb, 0, BLOCK);
    sums[0] = sums[1] = 0;
    return NAN;
  }
  const float amax = _mm512_reduce_max_ps(a);
  if (amax < TINY) {
    std::memset(qb, 0, BLOCK);
    sums[0] = sums[1] = 0;
    return 0.f;
  }
  const __m512 inv = _mm512_set1_ps(127.f / amax), bound = _mm512_set1_ps(127.f);
  const auto q = [&](__m512 x, int8_t* out, int32_t* sum) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i i = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(v, bound), -bound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(i));
    *sum = _mm512_reduce_add_epi32(i);
  };
  q(lo, qb, sums);
  q(hi, qb + 16, sums + 1);
  return amax / 127.f;
#else
  float amax = 0.f;
  bool finite = true;
  for (int64_t j = 0; j < BLOCK; j++) {
    const float a = std::fabs(xb[j]);
    if (!(a <= FLT_MAX)) finite = false;
    else if (a > amax) amax = a;
  }
  sums[0] = sums[1] = 0;
  if (!finite || amax < TINY) {
    std::memset(qb, 0, BLOCK);
    return finite ? 0.f : NAN;
  }
  const float inv = 127.f / amax;
  for (int64_t j = 0; j < BLOCK; j++) {
    const float v = std::nearbyint(xb[j] * inv);
    qb[j] = static_cast<int8_t>(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
    sums[j / 16] += qb[j];
  }
  return amax / 127.f;
#endif
}

Rounded round_rows(const float* x, int64_t M, int64_t K) {
  const auto n16 = static_cast<size_t>(M * K / 16), n32 = static_cast<size_t>(M * K / 32);
  Rounded r{std::vector<int8_t>(static_cast<size_t>(M * K)), std::vector<float>(static_cast<size_t>(M * K / BLOCK)),
            std::vector<int32_t>(n16), std::vector<int32_t>(n32), std::vector<float>(n16), std::vector<float>(n32)};
  // a few rows round on the calling thread: a parallel region costs more than they do
  at::parallel_for(0, M * K / BLOCK, M <= TILE ? M * K / BLOCK : 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      r.d[b] = round_block(x + b * BLOCK, r.q.data() + b * BLOCK, r.sums16.data() + 2 * b);
      r.sums32[b] = r.sums16[2 * b] + r.sums16[2 * b + 1];
      r.fsums16[2 * b] = static_cast<float>(r.sums16[2 * b]);
      r.fsums16[2 * b + 1] = static_cast<float>(r.sums16[2 * b + 1]);
      r.fsums32[b] = static_cast<float>(r.sums32[b]);
    }
  });
  return r;
}

// A group's scales as fp32 vectors: s, and o (offsets)
struct Scales {
  V s, o;
  const uint8_t* ints;
};

template <bool OFF>
inline Scales scales_at(const Header& h, const uint8_t* panel, int64_t g) {
  Scales r;
  constexpr int off = OFF;
  const uint8_t* base = panel + h.super_bytes + g * h.group_bytes;
  if (h.scale_mode == blob::SCALES_TWO_LEVEL) {  // s = d sc, o = (-dmin) m: exact products
    const float* d = reinterpret_cast<const float*>(panel + (g / h.super_groups) * 4 * OUT * (1 + off));
    r.s = tfq::vmul(tfq::vload(d), int8s(base));
    if (OFF) r.o = tfq::vmul(tfq::vload(d + OUT), int8s(base + OUT));
    r.ints = base + OUT * (1 + off);
  } else {
    const float* s = reinterpret_cast<const float*>(base);
    r.s = tfq::vload(s);
    if (OFF) r.o = tfq::vload(s + OUT);
    r.ints = base + 4 * OUT * (1 + off);
  }
  return r;
}

// Rows row0 .. row0 + R - 1 of one panel (steps 2 and 3); y and bias start at the panel's first output. ZERO: the
// blob's zero may not be 0, so each integer starts at -zero * b (the same integer as subtracting it at the end)
template <int BITS, bool OFF, bool ZERO, int R>
void tile(const Header& h, const uint8_t* panel, const Rounded& x, int64_t row0, const float* bias, float* y,
          int64_t N, int64_t outputs) {
  constexpr int64_t G = BITS == 6 ? 16 : 32;  // GGUF's groups: Q6_K's 16, the others' 32
  constexpr int chunks = BITS == 8 ? G / 4 : G / 8;
  const int64_t K = h.k, ahead = reach_l1.load(std::memory_order_relaxed),
                ahead_l2 = reach_l2.load(std::memory_order_relaxed);
  const int32_t zero = h.zero;
  const int8_t* xq[R];
  const int32_t* xs[R];
  const float *xf[R], *xd[R];
  for (int i = 0; i < R; i++) {
    xq[i] = x.q.data() + (row0 + i) * K;
    xs[i] = (G == 16 ? x.sums16.data() : x.sums32.data()) + (row0 + i) * (K / G);
    xf[i] = (G == 16 ? x.fsums16.data() : x.fsums32.data()) + (row0 + i) * (K / G);
    xd[i] = x.d.data() + (row0 + i) * (K / BLOCK);
  }
  V acc[R];
  for (int i = 0; i < R; i++) acc[i] = tfq::vzero();
  for (int64_t g = 0; g < K / G; g++) {
    const Scales sc = scales_at<OFF>(h, panel, g);
    const uint8_t *near = sc.ints + ahead, *far = sc.ints + ahead_l2;  // one register each, not one per chunk
    TFQ_PREFETCH(near - OUT * 2);  // the group's scales, ahead
    const int64_t k0 = g * G;
    I dot[R];
    for (int i = 0; i < R; i++) dot[i] = ZERO ? iset(-zero * xs[i][g]) : izero();
    B plane;
    if (BITS == 5 || BITS == 6) {
      TFQ_PREFETCH(near + 64 * chunks);
      plane = bload(sc.ints + 64 * chunks);
    }
    for (int c = 0; c < chunks; c++) {
      TFQ_PREFETCH(near + 64 * c);
      TFQ_PREFETCH_L2(far + 64 * c);
      const B a = bload(sc.ints + 64 * c);
      if (BITS == 8) {
        for (int i = 0; i < R; i++) dot[i] = idot<true>(dot[i], a, xq[i] + k0 + 4 * c);
        continue;
      }
      B lo = band(a, 15), hi = band(bshr(a, 4), 15);
      if (BITS == 5 || BITS == 6) {
        constexpr int H = BITS - 4;
        constexpr uint8_t MASK = BITS == 5 ? 0x10 : 0x30;
        lo = bor(lo, band(bshl(plane, 4 - c * H), MASK));
        hi = bor(hi, band(bshr(plane, c * H), MASK));
      }
      for (int i = 0; i < R; i++) {  // each four bytes read apart: a broadcast from memory, not through a register
        dot[i] = idot<false>(dot[i], lo, xq[i] + k0 + 8 * c);
        dot[i] = idot<false>(dot[i], hi, xq[i] + k0 + 8 * c + 4);
      }
    }
    for (int i = 0; i < R; i++) {
      V t = tfq::vmul(sc.s, tofloat(dot[i]));
      if (OFF) t = tfq::vadd(t, tfq::vmul(sc.o, tfq::vbroadcast(xf[i][g])));
      acc[i] = tfq::vadd(acc[i], tfq::vmul(tfq::vbroadcast(xd[i][k0 / BLOCK]), t));
    }
  }
  alignas(64) float out[16];
  for (int i = 0; i < R; i++) {
    tfq::vstore(out, acc[i]);
    for (int64_t n = 0; n < outputs; n++) y[(row0 + i) * N + n] = out[n] + (bias ? bias[n] : 0.f);
  }
}

template <int BITS, bool OFF, bool ZERO>
void panel_rows(const Header& h, const uint8_t* panel, const Rounded& x, int64_t M, const float* bias, float* y,
                int64_t N, int64_t outputs) {
  int64_t r = 0;
  for (; r + TILE <= M; r += TILE) tile<BITS, OFF, ZERO, TILE>(h, panel, x, r, bias, y, N, outputs);
  switch (M - r) {  // the rest, in one narrower tile
    case 0: break;
    case 1: tile<BITS, OFF, ZERO, 1>(h, panel, x, r, bias, y, N, outputs); break;
    case 2: tile<BITS, OFF, ZERO, 2>(h, panel, x, r, bias, y, N, outputs); break;
    case 3: tile<BITS, OFF, ZERO, 3>(h, panel, x, r, bias, y, N, outputs); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    case 4: tile<BITS, OFF, ZERO, 4>(h, panel, x, r, bias, y, N, outputs); break;
    case 5: tile<BITS, OFF, ZERO, 5>(h, panel, x, r, bias, y, N, outputs); break;
    case 6: tile<BITS, OFF, ZERO, 6>(h, panel, x, r, bias, y, N, outputs); break;
    default: tile<BITS, OFF, ZERO, 7>(h, panel, x, r, bias, y, N, outputs); break;
#endif
  }
}

using PanelFn = void (*)(const Header&, const uint8_t*, const Rounded&, int64_t, const float*, float*, int64_t,
                         int64_t);

template <bool OFF, bool ZERO>
PanelFn with_bits(int bits) {
  switch (bits) {
    case 4: return &panel_rows<4, OFF, ZERO>;
    case 5: return &panel_rows<5, OFF, ZERO>;
    case 6: return &panel_rows<6, OFF, ZERO>;
    default: return &panel_rows<8, OFF, ZERO>;
  }
}

// The formats with offsets have zero 0 (GGUF's K and _1 formats) but MLX's 8 bits (-128); the others a zero
PanelFn panel_fn(const Header& h) {
  if (!h.has_offset) return with_bits<false, true>(h.bits);
  return h.zero == 0 ? with_bits<true, false>(h.bits) : with_bits<true, true>(h.bits);
}

// Each segment's first panel among the blob's (and the panel count last), and its panel function
using PanelJobs = std::pair<std::vector<int64_t>, std::vector<PanelFn>>;
PanelJobs panel_jobs(const std::vector<Segment>& segs) {
  std::vector<int64_t> job_start{0};
  std::vector<PanelFn> fns;
  for (const Segment& s : segs) {
    job_start.push_back(job_start.back() + s.h.panels);
    fns.push_back(panel_fn(s.h));
  }
  return {job_start, fns};
}

void linear(const at::Tensor& x, const std::vector<Segment>& segs, const float* bias, float* y, int64_t N) {
  const int64_t M = x.size(0), K = segs[0].h.k;
  const Rounded rounded = round_rows(x.data_ptr<float>(), M, K);
  const auto panels = panel_jobs(segs);  // named, not bound: the threads' lambda captures them
  const std::vector<int64_t>& job_start = panels.first;
  const std::vector<PanelFn>& fns = panels.second;
  // Threads take runs of panels as they come free (claims.h), not a fixed half each: on a busy machine a thread
  // that is held up then costs its run, not the call. Which thread computes a panel never changes its bits. A
  // small layer still goes in runs of about a 16th of it, not 64ths: each run is a stream the prefetches must
  // start again, and the default model's decode step took 21-23 ms in 64 against 20-21 in 16 (or 8). The runs
  // shrink as the layer ends: with runs of a fixed size, a 27B shape's large layers left one of two threads idle
  // for 170-190 us a call while the other finished its last run (10-16 us with runs that shrink).
  const int64_t jobs = job_start.back(), chunk = std::max<int64_t>(1, std::min<int64_t>(CHUNK, jobs / 16));
  Claims claims(jobs, chunk, at::get_num_threads());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (auto run = claims.next(); run.first < run.second; run = claims.next()) {
      size_t s = 0;
      for (int64_t p = run.first; p < run.second; p++) {
        while (p >= job_start[s + 1]) s++;
        const Segment& seg = segs[s];
        const int64_t local = p - job_start[s], out = seg.first + local * OUT;
        fns[s](seg.h, seg.panels + local * seg.h.panel_bytes, rounded, M, bias ? bias + out : nullptr, y + out, N,
               std::min(OUT, seg.h.n - local * OUT));
      }
    }
  });
}

bool glu_pairs(const std::vector<Segment>& segs, int64_t I) {
  bool paired = segs[0].h.magic == blob::MAGIC_Q8 && I % OUT == 0 && segs.back().first + segs.back().h.n == 2 * I;
  for (const Segment& s : segs) paired = paired && s.h.n % OUT == 0;  // panel p: outputs [16 p, 16 p + 16)
  return paired;
}

namespace {
// silu(gate) * up of `runs` panels' outputs at M rows, from the gate's and the up's [M, runs * 16] to y [M, ...]
// (row stride I): silu_mul's lanes (layer_parts.h), the same roundings
void silu_times_up(const float* gate, const float* up, int64_t M, int64_t runs, float* y, int64_t I) {
  const int64_t width = runs * OUT;
  for (int64_t m = 0; m < M; m++)
    for (int64_t i = 0; i < width; i += OUT)
      tfq::vstore(y + m * I + i, tfq::vmul(tfq::vsilu(tfq::vload(gate + m * width + i)),
                                          tfq::vload(up + m * width + i)));
}

// silu(gate) * up of a run of `runs` panel pairs of a gate_up blob, from gate panel `first` (its up panels I / 16
// after), at M rows into y (row stride I): the run's gate panels, then its up panels, into gate and up [M, runs * 16]
void glu_run(const std::vector<Segment>& segs, const PanelJobs& jobs_of, const Rounded& rows, int64_t M, int64_t first,
             int64_t runs, int64_t I, std::vector<float>& gate, std::vector<float>& up, float* y) {
  const std::vector<int64_t>& job_start = jobs_of.first;
  const int64_t width = runs * OUT;
  gate.resize(static_cast<size_t>(M * width));
  up.resize(gate.size());
  for (int half = 0; half < 2; half++) {
    size_t s = 0;
    for (int64_t q = 0; q < runs; q++) {
      const int64_t p = first + q + half * (I / OUT);
      while (p >= job_start[s + 1]) s++;
      const Segment& seg = segs[s];
      jobs_of.second[s](seg.h, seg.panels + (p - job_start[s]) * seg.h.panel_bytes, rows, M, nullptr,
                        (half ? up : gate).data() + q * OUT, width, OUT);
    }
  }
  silu_times_up(gate.data(), up.data(), M, runs, y + first * OUT, I);
}
}  // namespace

at::Tensor linear_glu(const at::Tensor& x, const at::Tensor& blob, int64_t I) {
  const std::vector<Segment> segs = blob::segments_of(blob);
  if (!glu_pairs(segs, I)) return {};
  TORCH_CHECK(x.dim() == 2 && x.size(1) == segs[0].h.k && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tfq linear_glu: x [M, K] fp32, contiguous");
  const int64_t M = x.size(0), K = segs[0].h.k, pairs = I / OUT;
  auto y = tfq::pool::empty({M, I}, x.options());
  if (M == 0) return y;
  const Rounded rounded = round_rows(x.data_ptr<float>(), M, K);
  const PanelJobs jobs_of = panel_jobs(segs);
  float* yp = y.data_ptr<float>();
  // as `linear` takes panels, a run of gate panels and then the run of up panels I / 16 after them
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(CHUNK, pairs / 16));
  Claims claims(pairs, chunk, at::get_num_threads());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> gate, up;  // [M, a run's outputs]
    for (auto run = claims.next(); run.first < run.second; run = claims.next())
      glu_run(segs, jobs_of, rounded, M, run.first, run.second - run.first, I, gate, up, yp);
  });
  return y;
}

namespace {
// Product i's rows rounded, once for products in a row that share them (a decode step's lane sends its one row to
// each of its experts' gate_ups): the same bits either way. `done` holds the roundings so far, with room reserved
// for one a product (its elements never move).
const Rounded* rounded_for(const std::vector<quant::Product>& products, size_t i, std::vector<Rounded>& done) {
  const quant::Product& p = products[i];
  const int64_t K = (*p.segs)[0].h.k;
  const quant::Product* before = i > 0 ? &products[i - 1] : nullptr;
  if (!before || before->x != p.x || before->M != p.M || (*before->segs)[0].h.k != K)
    done.push_back(round_rows(p.x, p.M, K));
  return &done.back();
}
}  // namespace

void linear_many_glu(const std::vector<quant::Product>& products, int64_t I) {
  std::vector<Rounded> rounded;  // the products' rows, rounded once for all their panels
  rounded.reserve(products.size());
  std::vector<const Rounded*> rows_of;  // each product's
  std::vector<PanelJobs> jobs_of;  // each product's blob's panels
  struct Job {  // a run of gate panels and the run of up panels I / 16 after them, as linear_glu takes them
    size_t product;
    int64_t first, runs;  // the run's first gate panel in the blob, and its length
  };
  constexpr int64_t RUN = 16;  // panels a run: a 30B-A3B's experts took 0.9 ms less a step than one gate, one up
  std::vector<Job> jobs;
  for (size_t i = 0; i < products.size(); i++) {
    TORCH_CHECK(glu_pairs(*products[i].segs, I), "tfq q8 linear_many_glu: gate_up blobs of 2 x ", I,
                " outputs in whole panels");
    rows_of.push_back(rounded_for(products, i, rounded));
    jobs_of.push_back(panel_jobs(*products[i].segs));
    for (int64_t j = 0; j < I / OUT; j += RUN) jobs.push_back({i, j, std::min(RUN, I / OUT - j)});
  }
  // contiguous runs of jobs, as linear_many
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> gate, up;  // [M, a run's outputs]
    for (int64_t j = j0; j < j1; j++) {
      const Job& job = jobs[j];
      const quant::Product& p = products[job.product];
      glu_run(*p.segs, jobs_of[job.product], *rows_of[job.product], p.M, job.first, job.runs, I, gate, up, p.y);
    }
  });
}

void linear_many(const std::vector<quant::Product>& products) {
  std::vector<Rounded> rounded;  // the products' rows, rounded once for all their panels
  rounded.reserve(products.size());
  std::vector<const Rounded*> rows_of;  // each product's
  struct Job {
    PanelFn fn;
    const Segment* seg;
    int64_t local;  // the panel's index in its segment
    size_t product;
  };
  std::vector<Job> jobs;
  for (size_t i = 0; i < products.size(); i++) {
    const quant::Product& p = products[i];
    rows_of.push_back(rounded_for(products, i, rounded));
    for (const Segment& seg : *p.segs) {
      TORCH_CHECK(seg.h.magic == blob::MAGIC_Q8, "tfq q8 linear_many: blobs of quant_q8.cpp's layout");
      const PanelFn fn = panel_fn(seg.h);
      for (int64_t local = 0; local < seg.h.panels; local++) jobs.push_back({fn, &seg, local, i});
    }
  }
  // contiguous runs, not the shared counter of `linear`: a small matrix's panels taken one by one by turns would
  // leave each thread's stream (and its prefetches, which run on past a panel's end) full of the other's panels
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
      const Job& job = jobs[j];
      const Segment& seg = *job.seg;
      const quant::Product& p = products[job.product];
      const int64_t out = seg.first + job.local * OUT;
      job.fn(seg.h, seg.panels + job.local * seg.h.panel_bytes, *rows_of[job.product], p.M,
             p.bias ? p.bias + out : nullptr, p.y + out, p.N, std::min(OUT, seg.h.n - job.local * OUT));
    }
  });
}

namespace {

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// qpack's arguments (quant.cpp), for GGUF's formats (one rounding): q [N, K] uint8 (int8 bit patterns for 8
// bits), s and o [N, K / G] fp32, and for the K formats the two levels sd, sq (od, oq). One segment.
at::Tensor qpack_q8(const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& o, int64_t bits,
                    int64_t group, int64_t zero, const c10::optional<at::Tensor>& sd,
                    const c10::optional<at::Tensor>& sq, const c10::optional<at::Tensor>& od,
                    const c10::optional<at::Tensor>& oq) {
  // the groups `tile` takes (16 for 6 bits, else 32): a blob of 4 or 8 bits in groups of 16 was packed, then summed
  // as groups of 32
  TORCH_CHECK(((bits == 4 || bits == 5 || bits == 8) && group == 32) || (bits == 6 && group == 16),
              "tfq qpack_q8: 4, 5 or 8 bits in groups of 32, 6 bits in groups of 16");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) % BLOCK == 0,
              "tfq qpack_q8: q [N, K] uint8 with K a multiple of 32");
  const int64_t N = q.size(0), K = q.size(1), groups = K / group;
  const auto sc = blob::checked_scales("tfq qpack_q8", N, groups, s, o, sd, sq, od, oq);
  const bool two = sd.has_value();
  const int off = o.has_value() ? 1 : 0;
  const int64_t int_bytes = OUT * group * bits / 8;
  Header h{blob::MAGIC_Q8, static_cast<int16_t>(bits), 0, static_cast<int32_t>(group),
           static_cast<int32_t>(bits == 8 ? zero + 128 : zero), static_cast<int16_t>(off),
           static_cast<int16_t>(two ? blob::SCALES_TWO_LEVEL : blob::SCALES_FP32), 0,
           static_cast<int16_t>(two ? groups / sc.supers : 0), N, K, (N + OUT - 1) / OUT, 0, 0, 0};
  h.group_bytes = static_cast<int32_t>((two ? 1 : 4) * OUT * (1 + off) + int_bytes);
  h.super_bytes = static_cast<int32_t>(two ? sc.supers * 4 * OUT * (1 + off) : 0);
  h.panel_bytes = h.super_bytes + groups * h.group_bytes;
  auto out = tfq::weights_memory(blob::segment_bytes(h));
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::memcpy(dst, &h, sizeof h);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  std::atomic<bool> agree{true};
  at::parallel_for(0, h.panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
      uint8_t* panel = dst + blob::HEADER + p * h.panel_bytes;
      std::memset(panel, 0, static_cast<size_t>(h.panel_bytes));
      for (int64_t j = 0; j < OUT; j++) {
        const int64_t n = p * OUT + j;
        if (n >= N) continue;  // outputs past N: zero bytes, never stored
        for (int64_t u = 0; u < sc.supers; u++) {
          float* d = reinterpret_cast<float*>(panel + u * 4 * OUT * (1 + off));
          d[j] = sc.sd[n * sc.supers + u];
          if (off) d[OUT + j] = -sc.od[n * sc.supers + u];
        }
        for (int64_t g = 0; g < groups; g++) {
          uint8_t* base = panel + h.super_bytes + g * h.group_bytes;
          const int64_t i = n * groups + g;
          if (two) {
            const int64_t u = n * sc.supers + g / h.super_groups;
            base[j] = static_cast<uint8_t>(sc.sq[i]);
            if (off) base[OUT + j] = static_cast<uint8_t>(sc.oq[i]);
            if (!same_bits(sc.sd[u] * static_cast<float>(sc.sq[i]), sc.s[i]) ||
                (off && !same_bits(-sc.od[u] * static_cast<float>(sc.oq[i]), sc.o[i])))
              agree = false;
          } else {
            float* gs = reinterpret_cast<float*>(base);
            gs[j] = sc.s[i];
            if (off) gs[OUT + j] = sc.o[i];
          }
          uint8_t* ints = base + (two ? 1 : 4) * OUT * (1 + off);
          const uint8_t* row = qp + n * K + g * group;
          for (int64_t k = 0; k < group; k++) {
            const uint8_t v = row[k];
            if (bits == 8) {
              ints[64 * (k / 4) + 4 * j + k % 4] = static_cast<uint8_t>(v ^ 0x80);
              continue;
            }
            const int64_t c = k / 8, half = (k % 8) / 4, b = k % 4;
            ints[64 * c + 4 * j + b] |= static_cast<uint8_t>((v & 15) << (4 * half));
            if (bits == 4) continue;
            uint8_t* plane = ints + 64 * (group / 8) + 4 * j + b;
            const int H = static_cast<int>(bits) - 4;
            for (int t = 0; t < H; t++)
              *plane |= static_cast<uint8_t>(((v >> (4 + t)) & 1) << (4 * half + c * H + t));
          }
        }
      }
    }
  });
  TORCH_CHECK(agree.load(), "tfq qpack_q8: the two-level scales do not multiply to s and o");
  return out;
}

// the prefetch distances (bytes into L1, into L2): set by a pair of values >= 0, read by (-1, -1); the pair in force
std::vector<int64_t> q8_prefetch(int64_t l1, int64_t l2) {
  TORCH_CHECK((l1 == -1 && l2 == -1) || (l1 >= 0 && l2 >= 0),
              "tfq q8_prefetch: two distances in bytes, each 0 or more (or neither, to read them)");
  if (l1 >= 0) reach_l1 = l1, reach_l2 = l2;
  return {reach_l1.load(), reach_l2.load()};
}

// linear_glu as an op, for the kernel checks; a blob whose panels do not pair is refused
at::Tensor qlinear_glu(const at::Tensor& x, const at::Tensor& blob, int64_t I) {
  TORCH_CHECK(blob.scalar_type() == at::kByte, "tfq qlinear_glu: a blob from qpack_q8");
  at::Tensor y = linear_glu(x, blob, I);
  TORCH_CHECK(y.defined(), "tfq qlinear_glu: the blob is not 2 x ", I, " outputs of quant_q8.cpp's layout in "
              "whole panels of 16");
  return y;
}

}  // namespace
}  // namespace tfq::q8

TORCH_LIBRARY_FRAGMENT(tfq_cpu, m) {
  m.def("qpack_q8(Tensor q, Tensor s, Tensor? o, int bits, int group, int zero, Tensor? sd=None, Tensor? sq=None, "
        "Tensor? od=None, Tensor? oq=None) -> Tensor");
  m.def("q8_prefetch(int l1=-1, int l2=-1) -> int[]", tfq::q8::q8_prefetch);
  m.def("qlinear_glu(Tensor x, Tensor blob, int intermediate) -> Tensor");
}
TORCH_LIBRARY_IMPL(tfq_cpu, CPU, m) {
  m.impl("qpack_q8", tfq::q8::qpack_q8);
  m.impl("qlinear_glu", tfq::q8::qlinear_glu);
}
