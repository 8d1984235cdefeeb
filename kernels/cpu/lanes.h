// 16 fp32 lanes, the unit of every fixed-order sum in tfq's CPU kernels: one AVX-512 register, two AVX2
// halves, four SSE quarters (x86-64's baseline: the fused multiply-add computed exactly in doubles, below), or
// 16 floats with fmaf (ARM and the rest: a hardware instruction there). Each operation is lane by lane and rounds
// once, so a recipe written with these gives the same bits on all of them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TFQ_PREFETCH(p) _mm_prefetch((const char*)(p), _MM_HINT_T0)
#define TFQ_PREFETCH_L2(p) _mm_prefetch((const char*)(p), _MM_HINT_T1)
#else
#define TFQ_PREFETCH(p) __builtin_prefetch(p, 0, 3)
#define TFQ_PREFETCH_L2(p) __builtin_prefetch(p, 0, 2)
#endif

namespace tfq {

// TFQ_PLAIN_LANES (the tests' build for -march=x86-64) takes the plain C++ lanes that ARM and other CPUs run
#if !defined(__SSE2__) || defined(__FMA__) || defined(TFQ_PLAIN_LANES)
inline float fma1(float a, float b, float c) { return std::fma(a, b, c); }  // one instruction where fma is
#endif

#if defined(__AVX512F__)
constexpr const char* LANES = "AVX-512";
struct V { __m512 a; };
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vbroadcast(float x) { return {_mm512_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vfma(V x, V w, V acc) { return {_mm512_fmadd_ps(x.a, w.a, acc.a)}; }
inline V vadd(V x, V y) { return {_mm512_add_ps(x.a, y.a)}; }
inline V vsub(V x, V y) { return {_mm512_sub_ps(x.a, y.a)}; }
inline V vmul(V x, V y) { return {_mm512_mul_ps(x.a, y.a)}; }
inline V vdiv(V x, V y) { return {_mm512_div_ps(x.a, y.a)}; }
inline V vmax(V x, V m) { return {_mm512_max_ps(x.a, m.a)}; }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v.a); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* LANES = "AVX2 + FMA";
struct V { __m256 lo, hi; };
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vbroadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vfma(V x, V w, V acc) { return {_mm256_fmadd_ps(x.lo, w.lo, acc.lo), _mm256_fmadd_ps(x.hi, w.hi, acc.hi)}; }
inline V vadd(V x, V y) { return {_mm256_add_ps(x.lo, y.lo), _mm256_add_ps(x.hi, y.hi)}; }
inline V vsub(V x, V y) { return {_mm256_sub_ps(x.lo, y.lo), _mm256_sub_ps(x.hi, y.hi)}; }
inline V vmul(V x, V y) { return {_mm256_mul_ps(x.lo, y.lo), _mm256_mul_ps(x.hi, y.hi)}; }
inline V vdiv(V x, V y) { return {_mm256_div_ps(x.lo, y.lo), _mm256_div_ps(x.hi, y.hi)}; }
inline V vmax(V x, V m) { return {_mm256_max_ps(x.lo, m.lo), _mm256_max_ps(x.hi, m.hi)}; }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
#elif defined(__SSE2__) && !defined(TFQ_PLAIN_LANES)
// x86-64 without AVX2 + FMA. fma(a, b, c) rounded once, from doubles: a * b is exact in a double (48 bits), and
// s = a * b + c rounded to a double rounds to the float the exact sum does, unless s is a point halfway between two
// floats (rounding to 53 bits can land on such a point, never cross it) or a float denormal (another spacing;
// a sum of 0 is exact).
// Those rare lanes take the sum rounded to odd instead (rounded to nearest, then, if inexact with its last bit
// even, one step toward the exact value, which TwoSum gives), which rounds to the right float at 53 bits (Boldo and
// Melquiond, 2008). NaNs and infinities pass through the arithmetic unchanged.
inline __m128d sum_to_odd(__m128d p, __m128d c, __m128d s) {
  const __m128d zero = _mm_setzero_pd(), cp = _mm_sub_pd(s, p);
  const __m128d e = _mm_add_pd(_mm_sub_pd(p, _mm_sub_pd(s, cp)), _mm_sub_pd(c, cp));  // exact: p + c - s
  const __m128i one = _mm_set1_epi64x(1), bits = _mm_castpd_si128(s);
  const __m128i inexact = _mm_castpd_si128(_mm_or_pd(_mm_cmplt_pd(e, zero), _mm_cmpgt_pd(e, zero)));  // NaN: no
  const __m128i even = _mm_sub_epi64(_mm_and_si128(bits, one), one);  // all ones where the last bit is 0
  const __m128i apart = _mm_srli_epi64(_mm_xor_si128(bits, _mm_castpd_si128(e)), 63);  // e's sign is not s's
  const __m128i step = _mm_sub_epi64(_mm_sub_epi64(one, apart), apart);  // +1: away from zero, -1: toward it
  return _mm_castsi128_pd(_mm_add_epi64(bits, _mm_and_si128(step, _mm_and_si128(inexact, even))));
}
inline __m128d fma2(__m128d p, __m128d c) {
  const __m128d s = _mm_add_pd(p, c);
  const __m128i low = _mm_and_si128(_mm_castpd_si128(s), _mm_set1_epi64x((1 << 29) - 1));
  const int halfway = _mm_movemask_epi8(_mm_cmpeq_epi32(low, _mm_set1_epi64x(1 << 28)));  // both halves of a lane
  const __m128d magnitude = _mm_and_pd(s, _mm_castsi128_pd(_mm_set1_epi64x(0x7FFFFFFFFFFFFFFF)));
  const int denormal = _mm_movemask_pd(_mm_and_pd(_mm_cmplt_pd(magnitude, _mm_set1_pd(0x1p-126)),
                                                  _mm_cmpgt_pd(magnitude, _mm_setzero_pd())));  // 0 is exact
  if ((halfway & 0xFF) == 0xFF || (halfway & 0xFF00) == 0xFF00 || denormal) return sum_to_odd(p, c, s);
  return s;
}
inline __m128 fma4(__m128 a, __m128 b, __m128 c) {
#if defined(__FMA__)
  return _mm_fmadd_ps(a, b, c);
#else
  const __m128d lo = fma2(_mm_mul_pd(_mm_cvtps_pd(a), _mm_cvtps_pd(b)), _mm_cvtps_pd(c));
  const __m128d hi = fma2(_mm_mul_pd(_mm_cvtps_pd(_mm_movehl_ps(a, a)), _mm_cvtps_pd(_mm_movehl_ps(b, b))),
                          _mm_cvtps_pd(_mm_movehl_ps(c, c)));
  return _mm_movelh_ps(_mm_cvtpd_ps(lo), _mm_cvtpd_ps(hi));
#endif
}
inline float fma1(float a, float b, float c) { return _mm_cvtss_f32(fma4(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))); }
#if defined(__FMA__)
constexpr const char* LANES = "SSE + FMA";
#else
constexpr const char* LANES = "SSE2, fma emulated";  // tfq.kernels.cpu_build.EMULATED: slow, the same bits
#endif
struct V { __m128 q[4]; };
#define TFQ_V4(expr) V v; for (int i = 0; i < 4; i++) v.q[i] = (expr); return v
inline V vzero() { TFQ_V4(_mm_setzero_ps()); }
inline V vbroadcast(float x) { TFQ_V4(_mm_set1_ps(x)); }
inline V vload(const float* p) { TFQ_V4(_mm_loadu_ps(p + 4 * i)); }
inline V vfma(V x, V w, V acc) { TFQ_V4(fma4(x.q[i], w.q[i], acc.q[i])); }
inline V vadd(V x, V y) { TFQ_V4(_mm_add_ps(x.q[i], y.q[i])); }
inline V vsub(V x, V y) { TFQ_V4(_mm_sub_ps(x.q[i], y.q[i])); }
inline V vmul(V x, V y) { TFQ_V4(_mm_mul_ps(x.q[i], y.q[i])); }
inline V vdiv(V x, V y) { TFQ_V4(_mm_div_ps(x.q[i], y.q[i])); }
inline V vmax(V x, V m) { TFQ_V4(_mm_max_ps(x.q[i], m.q[i])); }
#undef TFQ_V4
inline void vstore(float* p, V v) { for (int i = 0; i < 4; i++) _mm_storeu_ps(p + 4 * i, v.q[i]); }
#else
constexpr const char* LANES = "plain C++";
struct V { float f[16]; };
inline V vzero() { V v; for (int i = 0; i < 16; i++) v.f[i] = 0.f; return v; }
inline V vbroadcast(float x) { V v; for (int i = 0; i < 16; i++) v.f[i] = x; return v; }
inline V vload(const float* p) { V v; for (int i = 0; i < 16; i++) v.f[i] = p[i]; return v; }
inline V vfma(V x, V w, V acc) { V v; for (int i = 0; i < 16; i++) v.f[i] = std::fma(x.f[i], w.f[i], acc.f[i]); return v; }
inline V vadd(V x, V y) { V v; for (int i = 0; i < 16; i++) v.f[i] = x.f[i] + y.f[i]; return v; }
inline V vsub(V x, V y) { V v; for (int i = 0; i < 16; i++) v.f[i] = x.f[i] - y.f[i]; return v; }
inline V vmul(V x, V y) { V v; for (int i = 0; i < 16; i++) v.f[i] = x.f[i] * y.f[i]; return v; }
inline V vdiv(V x, V y) { V v; for (int i = 0; i < 16; i++) v.f[i] = x.f[i] / y.f[i]; return v; }
inline V vmax(V x, V m) { V v; for (int i = 0; i < 16; i++) v.f[i] = x.f[i] > m.f[i] ? x.f[i] : m.f[i]; return v; }
inline void vstore(float* p, V v) { for (int i = 0; i < 16; i++) p[i] = v.f[i]; }
#endif

// vmax(x, m): x where x > m, else m, lane by lane (the instruction sets' max: a NaN in x keeps m, and of two
// zeros m is kept), so a running max over vectors skips NaNs as the scalar (m < x ? x : m) does.

// the lanes added in a fixed tree: lane l + 8 into lane l, then l + 4, l + 2, and lane 1 into lane 0
inline float reduce(V v) {
  alignas(64) float f[16];
  vstore(f, v);
  for (int i = 0; i < 8; i++) f[i] = f[i] + f[i + 8];
  for (int i = 0; i < 4; i++) f[i] = f[i] + f[i + 4];
  for (int i = 0; i < 2; i++) f[i] = f[i] + f[i + 2];
  return f[0] + f[1];
}

// exp lane by lane, the same operations on every instruction set (Cephes' expf polynomial with fused
// multiply-adds), each rounding once, so AVX-512, AVX2 and plain C++ give the same bits: within 2 units in the
// last place. An argument below -87 (or NaN) gives 0 (the true result would be a denormal, where instruction
// sets round differently); one above 89 is taken as 89, whose exp is already inf. The scaling by 2^n is two
// multiplications by 2^(n >> 1) and 2^(n - (n >> 1)): the first is exact, the second rounds once, as ldexp does.
constexpr float EXP_LO = -87.0f, EXP_HI = 89.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
inline V vexp(V x) {
  const __mmask16 ok = _mm512_cmp_ps_mask(x.a, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ);
  const __m512 v = _mm512_min_ps(x.a, _mm512_set1_ps(EXP_HI));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
  __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i ni = _mm512_cvtps_epi32(n), n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23)));
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23)));
  return {_mm512_maskz_mov_ps(ok, y)};
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {
  const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
  const __m256 v = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
  __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23)));
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23)));
  return _mm256_and_ps(ok, y);
}
inline V vexp(V x) { return {exp8(x.lo), exp8(x.hi)}; }
#elif defined(__SSE2__) && !defined(TFQ_PLAIN_LANES)
inline __m128 exp4(__m128 x) {  // the recipe above, four lanes (a float -> int -> float is nearbyint here)
  const __m128 ok = _mm_cmpge_ps(x, _mm_set1_ps(EXP_LO));
  const __m128 v = _mm_min_ps(x, _mm_set1_ps(EXP_HI));
  const __m128i ni = _mm_cvtps_epi32(_mm_mul_ps(v, _mm_set1_ps(LOG2E)));
  const __m128 n = _mm_cvtepi32_ps(ni), minus = _mm_sub_ps(_mm_setzero_ps(), n);
  __m128 r = fma4(minus, _mm_set1_ps(LN2_HI), v);
  r = fma4(minus, _mm_set1_ps(LN2_LO), r);
  __m128 p = _mm_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; i++) p = fma4(p, r, _mm_set1_ps(EXP_P[i]));
  __m128 y = _mm_add_ps(fma4(p, _mm_mul_ps(r, r), r), _mm_set1_ps(1.0f));
  const __m128i n1 = _mm_srai_epi32(ni, 1), n2 = _mm_sub_epi32(ni, n1), bias = _mm_set1_epi32(127);
  y = _mm_mul_ps(y, _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(n1, bias), 23)));
  y = _mm_mul_ps(y, _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(n2, bias), 23)));
  return _mm_and_ps(ok, y);
}
inline V vexp(V x) { V v; for (int i = 0; i < 4; i++) v.q[i] = exp4(x.q[i]); return v; }
#else
inline V vexp(V x) {  // lane by lane (the baseline x86-64 and plain C++), the recipe above with fma1
  alignas(64) float in[16], out[16];
  vstore(in, x);
  for (int i = 0; i < 16; i++) {
    const float u = in[i];
    if (!(u >= EXP_LO)) {
      out[i] = 0.0f;
      continue;
    }
    const float v = std::min(u, EXP_HI);
    const float n = std::nearbyint(v * LOG2E);
    float r = fma1(-n, LN2_HI, v);
    r = fma1(-n, LN2_LO, r);
    float p = EXP_P[0];
    for (int k = 1; k < 6; k++) p = fma1(p, r, EXP_P[k]);
    const int ni = static_cast<int>(n), n1 = ni >> 1, n2 = ni - n1;
    const float y = fma1(p, r * r, r) + 1.0f;
    out[i] = (y * std::ldexp(1.0f, n1)) * std::ldexp(1.0f, n2);
  }
  return vload(out);
}
#endif

inline void exp16(const float* x, float* out) { vstore(out, vexp(vload(x))); }

// SiLU lane by lane: x / (1 + exp(-x)), with the exp above
inline V vsilu(V x) { return vdiv(x, vadd(vbroadcast(1.0f), vexp(vsub(vzero(), x)))); }

// RMS norm of one row x of n: ss = the squares as 16 lanes (lane l: fma(x_i, x_i, acc) for i = l, l + 16, ...),
// the lanes added in the fixed tree of `reduce`; r = 1 / sqrt(ss / n + eps); y_i = (x_i * r) * w_i.
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  V acc = vzero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const V v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  alignas(64) float lanes[16];
  vstore(lanes, acc);
  for (int64_t l = 0; i < n; i++, l++) lanes[l] = fma1(x[i], x[i], lanes[l]);  // a short tail
  const float ss = reduce(vload(lanes));
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; k++) y[k] = (x[k] * inv) * w[k];
}

// Each lane rounded to bfloat16, to nearest even, the value kept as fp32 (finite inputs): the rounding MLX applies
// after each operation on bf16 numbers. Integer operations only, so every instruction set gives the same bits.
#if defined(__AVX512F__)
inline V vround_bf16(V x) {
  const __m512i b = _mm512_castps_si512(x.a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return {_mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 round_bf16_8(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline V vround_bf16(V x) { return {round_bf16_8(x.lo), round_bf16_8(x.hi)}; }
#else
inline V vround_bf16(V x) {
  alignas(64) float f[16];
  vstore(f, x);
  for (int i = 0; i < 16; i++) {
    uint32_t b;
    std::memcpy(&b, &f[i], 4);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&f[i], &b, 4);
  }
  return vload(f);
}
#endif

// log(u) for a finite u >= 1 by one recipe (Cephes' logf polynomial with fused multiply-adds, u split by frexp,
// which is exact): libm's logf and log1pf differ between C libraries, and glibc picks an FMA variant by CPU.
inline float log1(float u) {
  int e;
  float m = std::frexp(u, &e);  // u = m 2^e, m in [0.5, 1)
  if (m < 0.707106781186547524f) {
    e -= 1;
    m = m + m - 1.0f;
  } else {
    m = m - 1.0f;
  }
  constexpr float P[9] = {7.0376836292e-2f, -1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f,
                          1.4249322787e-1f, -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f,
                          3.3333331174e-1f};
  const float z = m * m, fe = static_cast<float>(e);
  float p = P[0];
  for (int k = 1; k < 9; k++) p = fma1(p, m, P[k]);
  float y = (p * m) * z;
  y = fma1(fe, -2.12194440e-4f, y);
  y = fma1(-0.5f, z, y);
  return fma1(fe, 0.693359375f, m + y);
}

// log(1 + y) for y >= 0 with the log above: (1 + y) rounded, its log scaled by y / ((1 + y) - 1), which cancels
// the rounding of 1 + y (Goldberg's way), y itself where 1 + y rounds to 1
inline float log1p1(float y) {
  const float u = 1.0f + y;
  return u == 1.0f ? y : log1(u) * (y / (u - 1.0f));
}

inline float exp1(float x) {
  alignas(64) float in[16] = {x}, out[16];
  exp16(in, out);
  return out[0];
}

}  // namespace tfq
