// Float vectors for the CPU kernels, and conversions from the storage dtypes.
//
// GCC vector extensions: one vf is an AVX-512 register where the CPU has them, two AVX2 or
// four SSE registers otherwise, so the same source builds (-march=native) everywhere.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define RADIXSERVE_VEC_BF16 1
#else
#define RADIXSERVE_VEC_BF16 0
#endif

namespace radixserve_cpu {

constexpr int64_t kLanes = 16;
constexpr float kLog2e = 1.4426950408889634f;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline vf load_vf(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store_vf(float* p, vf x) { std::memcpy(p, &x, sizeof x); }

// 2^f for |f| <= 1/2: Cephes' exp2f polynomial (relative error ~2e-7).
inline vf exp2_fraction(vf f) {
  vf p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  return p * f + 1.0f;
}

// 2^x per lane for x in [-126, 127]: x = n + f with n the integer nearest x (to nearest even,
// by adding and subtracting 1.5 * 2^23), |f| <= 1/2; 2^f by ``fraction`` (a polynomial), 2^n
// by writing the exponent bits. Portable vector code: exp2v, and exp2_nonpositive without
// AVX-512.
template <typename Fraction>
inline vf exp2_by(vf x, Fraction&& fraction) {
  const vf round = splat(12582912.0f);  // 1.5 * 2^23
  const vf n = (x + round) - round;
  const vf p = fraction(x - n);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * (vf)bits;  // a vector cast reinterprets the bits
}

// 2^x per lane for x in [-126, 127] (clamped), 2^f by Cephes' exp2f polynomial (relative
// error ~2e-7). Below -126 it returns 2^-126, which is 0 for every purpose of these kernels.
inline vf exp2v(vf x) { return exp2_by(vmin(vmax(x, splat(-126.0f)), splat(127.0f)), exp2_fraction); }

// 2^f for |f| <= 1/2 to a softmax's precision: a degree-4 polynomial with p(0) = 1 exactly,
// its coefficients fitted to 2^f's relative error over [-1/2, 1/2] (largest 2.8e-6 in exact
// arithmetic, against 2e-9 for Cephes' in exp2_fraction; float rounding adds ~1e-7 to
// either). A probability is rounded to bf16 (relative 2^-9 = 2e-3)
// before it multiplies the values, so the last two of Cephes' six FMAs bought nothing there,
// and in a prefill's attention the exponentials' FMAs take the FMA ports from the dot
// products (the prefill kernel against Cephes': benchmarks/long_context.md, "A cheaper
// softmax for the prefill").
inline vf exp2_fraction_softmax(vf f) {
  vf p = splat(9.58283e-3f);
  p = p * f + 5.590636e-2f;
  p = p * f + 2.4024099e-1f;
  p = p * f + 6.931242e-1f;
  return p * f + 1.0f;
}

// 2^x for x <= 0 (a softmax's differences from its maximum), to a softmax's precision
// (exp2_fraction_softmax) in few instructions: x = n + f with n the integer nearest x (one
// roundscale, to nearest even), 2^n applied by scalef (p * 2^n, rounded once). Below -126 it
// returns 2^-126 times the polynomial, 0 for every purpose of these kernels. Every attention
// softmax takes it (never exp2v), so every path computes the same bits; without AVX-512 the
// same arithmetic in portable vector code.
inline vf exp2_nonpositive(vf x) {
  x = vmax(x, splat(-126.0f));
#if defined(__AVX512F__)
  const vf n = static_cast<vf>(_mm512_roundscale_ps(static_cast<__m512>(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const vf p = exp2_fraction_softmax(x - n);
  return static_cast<vf>(_mm512_scalef_ps(static_cast<__m512>(p), static_cast<__m512>(n)));
#else
  return exp2_by(x, exp2_fraction_softmax);
#endif
}

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of a float32: a shift, which vectorises (the c10 conversion may not).
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// kLanes values of any storage dtype as floats (float: a plain load).
template <typename T>
inline vf load_as_vf(const T* p) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return load_vf(reinterpret_cast<const float*>(p));
#if RADIXSERVE_VEC_BF16
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // widen: bf16 is a float's top half
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    vf x;
    std::memcpy(&x, &wide, sizeof x);
    return x;
#endif
  } else {
    float tmp[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) tmp[i] = to_float(p[i]);
    return load_vf(tmp);
  }
}

template <typename T>
inline void store_from_vf(T* p, vf x) {
  if constexpr (sizeof(T) == sizeof(float)) {
    store_vf(reinterpret_cast<float*>(p), x);
#if RADIXSERVE_VEC_BF16
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // One instruction for 16 values, rounding to nearest even as c10's conversion does (the
    // scalar loop made bf16 SiLU * up, RMSNorm and RoPE ~5x slower at prefill sizes); it
    // differs only for NaN payloads and float32 denormals, which it flushes to zero.
    __m512 v;
    std::memcpy(&v, &x, sizeof v);
    const __m256bh b = _mm512_cvtneps_pbh(v);
    std::memcpy(p, &b, sizeof b);
#endif
  } else {
    for (int64_t i = 0; i < kLanes; ++i) p[i] = from_float<T>(x[i]);
  }
}

}  // namespace radixserve_cpu
