// Shared pieces of the small-batch linear kernels (gemv.cpp, gemv_int4.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_GEMV 1
#include <immintrin.h>
#else
#define RADIXSERVE_GEMV 0
#endif

namespace radixserve_cpu::gemv {

#if RADIXSERVE_GEMV

constexpr int kNT = 4;  // outputs per tile (independent weight streams)
constexpr int kMT = 4;  // activation rows per tile (accumulators: kNT * kMT)

// Bytes of weight a thread gets at least: below it, waking a second thread costs more than
// it saves (a 64 KB slice streams in a few microseconds here).
constexpr int64_t kMinBytesPerThread = 64 * 1024;

inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) { return c10::BFloat16(f).x; }  // round to nearest even

inline __mmask16 tail_mask16(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline __mmask32 tail_mask32(int64_t n) { return static_cast<__mmask32>((1ull << n) - 1); }

// Call fn(integral_constant<NT>, integral_constant<MT>) for nt <= kNT outputs and
// mt <= MaxMT rows: one instantiation per tile shape.
template <int MaxMT, typename Fn>
inline void dispatch(int nt, int mt, Fn&& fn) {
  auto rows = [&](auto NT) {
    if constexpr (MaxMT >= 4) {
      if (mt >= 4) return fn(NT, std::integral_constant<int, 4>{});
      if (mt == 3) return fn(NT, std::integral_constant<int, 3>{});
    }
    if (mt >= 2) return fn(NT, std::integral_constant<int, 2>{});
    return fn(NT, std::integral_constant<int, 1>{});
  };
  switch (nt) {
    case 1: return rows(std::integral_constant<int, 1>{});
    case 2: return rows(std::integral_constant<int, 2>{});
    case 3: return rows(std::integral_constant<int, 3>{});
    default: return rows(std::integral_constant<int, 4>{});
  }
}

// Grain (in tiles of kNT outputs) so that each thread streams at least kMinBytesPerThread:
// small layers stay on one thread.
inline int64_t grain_for(int64_t k, double bytes_per_weight) {
  const double tile_bytes = static_cast<double>(kNT) * k * bytes_per_weight;
  return std::max<int64_t>(1, static_cast<int64_t>(kMinBytesPerThread / tile_bytes));
}

#endif  // RADIXSERVE_GEMV

}  // namespace radixserve_cpu::gemv
