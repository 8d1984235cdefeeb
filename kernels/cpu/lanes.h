// 16 fp32 lanes, the unit of every fixed-order sum in tfq's CPU kernels: one AVX-512 register, two AVX2
// halves, or 16 floats with fmaf. Each operation is lane by lane and rounds once, so a recipe written with
// these gives the same bits on all three.
#pragma once

#include <cmath>
#include <limits>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TFQ_PREFETCH(p) _mm_prefetch((const char*)(p), _MM_HINT_T0)
#else
#define TFQ_PREFETCH(p) __builtin_prefetch(p)
#endif

namespace tfq {

#if defined(__AVX512F__)
struct V { __m512 a; };
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vbroadcast(float x) { return {_mm512_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vfma(V x, V w, V acc) { return {_mm512_fmadd_ps(x.a, w.a, acc.a)}; }
inline V vadd(V x, V y) { return {_mm512_add_ps(x.a, y.a)}; }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v.a); }
#elif defined(__AVX2__) && defined(__FMA__)
struct V { __m256 lo, hi; };
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vbroadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vfma(V x, V w, V acc) { return {_mm256_fmadd_ps(x.lo, w.lo, acc.lo), _mm256_fmadd_ps(x.hi, w.hi, acc.hi)}; }
inline V vadd(V x, V y) { return {_mm256_add_ps(x.lo, y.lo), _mm256_add_ps(x.hi, y.hi)}; }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
#else
struct V { float f[16]; };
inline V vzero() { V v; for (int i = 0; i < 16; i++) v.f[i] = 0.f; return v; }
inline V vbroadcast(float x) { V v; for (int i = 0; i < 16; i++) v.f[i] = x; return v; }
inline V vload(const float* p) { V v; for (int i = 0; i < 16; i++) v.f[i] = p[i]; return v; }
inline V vfma(V x, V w, V acc) { V v; for (int i = 0; i < 16; i++) v.f[i] = std::fma(x.f[i], w.f[i], acc.f[i]); return v; }
inline V vadd(V x, V y) { V v; for (int i = 0; i < 16; i++) v.f[i] = x.f[i] + y.f[i]; return v; }
inline void vstore(float* p, V v) { for (int i = 0; i < 16; i++) p[i] = v.f[i]; }
#endif

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
// multiply-adds): within 2 units in the last place; an argument below -87 gives 0 (the true result would be a
// denormal, where instruction sets round differently), one above 88.7 gives inf.
inline void exp16(const float* x, float* out) {
  for (int i = 0; i < 16; i++) {
    float v = x[i];
    if (!(v >= -87.0f)) {  // -inf and below -87: 0
      out[i] = 0.0f;
      continue;
    }
    float n = std::nearbyint(v * 1.44269504088896341f);
    float r = std::fma(-n, 0.693359375f, v);
    r = std::fma(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    float y = std::fma(p, r * r, r) + 1.0f;
    out[i] = std::ldexp(y, static_cast<int>(n));  // exact: n >= -126 keeps the result normal
  }
}

inline float exp1(float x) {
  alignas(64) float in[16] = {x}, out[16];
  exp16(in, out);
  return out[0];
}

}  // namespace tfq
