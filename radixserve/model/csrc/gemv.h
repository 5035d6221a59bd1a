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
constexpr int kMT = 4;  // activation rows per tile or row block (int4's tile: kNT * kMT accumulators)

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

// --- Horizontal sums of many accumulators at once, in _mm512_reduce_add_ps's order -------
//
// GCC's _mm512_reduce_add_ps (avx512fintrin.h, __MM512_REDUCE_OP) adds a vector's 16 lanes
// in a fixed tree: lane i + (i + 8) for i < 8, then i + (i + 4) for i < 4, then i + (i + 2)
// for i < 2, then 0 + 1. The 1-row kernels sum each output that way, one vector at a time
// (~9 instructions a vector). sum_lanes runs the same tree on up to 16 vectors together
// (~3 instructions a vector): each level folds two vectors into one, every lane of the
// result holding one addition of that level for one of them. Float addition is commutative
// bit for bit, so pairing the same lanes at the same level gives every sum the same bits.

// One level, S = 8, 4, 2, 1: lane p gets x[p] + x[p ^ S] where bit S of p is clear and
// y[p] + y[p ^ S] where it is set. After it, the lanes that agree in bit S and above hold
// one vector's partial sums, at the positions (the bits below S) reduce_add_ps has them in.
template <int S>
inline __m512 fold(__m512 x, __m512 y) {
  constexpr __mmask16 from_y = S == 8 ? 0xFF00 : S == 4 ? 0xF0F0 : S == 2 ? 0xCCCC : 0xAAAA;
  __m512 partner;  // the lane p ^ S of the vector lane p adds from
  if constexpr (S == 8) {
    partner = _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 3, 2));
  } else if constexpr (S == 2) {
    partner = _mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 3, 2));
  } else {  // lane p ^ S of x (index < 16) or of y (index 16 + ...)
    const __m512i p = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i s = _mm512_set1_epi32(S);
    const __m512i y_bit = _mm512_slli_epi32(_mm512_and_si512(p, s), 4 - __builtin_ctz(S));  // 16 or 0
    const __m512i idx = _mm512_or_si512(_mm512_xor_si512(p, s), y_bit);
    partner = _mm512_permutex2var_ps(x, idx, y);
  }
  return _mm512_add_ps(_mm512_mask_blend_ps(from_y, x, y), partner);
}

// One level over the first Len vectors of v: v[i] = fold(v[2 i], v[2 i + 1]) (the last one
// with itself when Len is odd: its lanes then hold the same sums twice).
template <int S, int Len, int C>
inline void fold_pairs(__m512 (&v)[C]) {
#pragma GCC unroll 8
  for (int i = 0; i < (Len + 1) / 2; ++i) v[i] = fold<S>(v[2 * i], v[std::min(2 * i + 1, Len - 1)]);
}

// The lane in which sum_lanes leaves vector c's sum: level S = 8 >> b chose by bit b of c.
constexpr int sum_lane(int c) { return ((c & 1) << 3) | ((c & 2) << 1) | ((c & 4) >> 1) | ((c & 8) >> 3); }

// The sums of v[0..C) (C <= 16), each added exactly as _mm512_reduce_add_ps adds it, in lanes
// sum_lane(c) of the result. Overwrites v.
template <int C>
inline __m512 sum_lanes(__m512 (&v)[C]) {
  static_assert(C >= 1 && C <= 16, "16 lanes hold 16 sums");
  constexpr int c1 = (C + 1) / 2, c2 = (c1 + 1) / 2, c3 = (c2 + 1) / 2;
  fold_pairs<8, C>(v);
  fold_pairs<4, c1>(v);
  fold_pairs<2, c2>(v);
  fold_pairs<1, c3>(v);
  return v[0];
}

// Call fn(integral_constant<MT>) for mt <= MaxMT rows: one instantiation per row count.
template <int MaxMT, typename Fn>
inline void dispatch_rows(int mt, Fn&& fn) {
  if constexpr (MaxMT >= 4) {
    if (mt >= 4) return fn(std::integral_constant<int, 4>{});
    if (mt == 3) return fn(std::integral_constant<int, 3>{});
  }
  if (mt >= 2) return fn(std::integral_constant<int, 2>{});
  return fn(std::integral_constant<int, 1>{});
}

// Call fn(integral_constant<NT>, integral_constant<MT>) for nt <= kNT outputs and
// mt <= MaxMT rows: one instantiation per tile shape.
template <int MaxMT, typename Fn>
inline void dispatch(int nt, int mt, Fn&& fn) {
  auto rows = [&](auto NT) { dispatch_rows<MaxMT>(mt, [&](auto MT) { fn(NT, MT); }); };
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

// --- Entry points for callers that run their own threads (a fused decoder layer) -----------
//
// Each computes out[r, 4 t : 4 t + 4] for every row r < m and the tiles t in
// [tile_begin, tile_end) of 4 outputs, on the calling thread only, into a caller-provided
// row-major [M, N] output: any split of [0, dense_tiles(n)) over threads gives the same bits
// as the torch ops (which split it over torch's pool). Weights row-major [N, K] in place.

// Tiles of 4 outputs over n outputs (the last may be partial): (n + 3) / 4.
inline int64_t dense_tiles(int64_t n) { return (n + 3) / 4; }

// float32 x [M, K], w [N, K], optional float32 bias [N] (nullptr: none) -> float32 out.
void dense_rows_f32(const float* x, int64_t m, const float* w, const float* bias, int64_t n, int64_t k,
                    int64_t tile_begin, int64_t tile_end, float* out);

// bf16 x [M, K], w [N, K], optional float32 bias [N] -> bf16 out (float32 sums, one rounding).
void dense_rows_bf16(const uint16_t* x_bf16, int64_t m, const uint16_t* w_bf16, const float* bias, int64_t n,
                     int64_t k, int64_t tile_begin, int64_t tile_end, uint16_t* out_bf16);

// --- int8 (gemv_int8.cpp) ----------------------------------------------------------------
//
// bf16 x [M, K] (K even), int8 codes in ``pack_int8``'s block layout ([ceil(N / 64), K / 2,
// 64, 2]), bf16 per-output scale [N] -> bf16 out [M, N] = (x @ q.T) * scale, for the blocks
// of 16 outputs in [block_begin, block_end) (the last may be partial), on the calling thread.
void int8_rows(const uint16_t* x_bf16, int64_t m, const int8_t* packed, const uint16_t* scale_bf16, int64_t n,
               int64_t k, int64_t block_begin, int64_t block_end, uint16_t* out_bf16);

// --- int4 (gemv_int4.cpp) ----------------------------------------------------------------
//
// The weight in ``pack_int4``'s layout: uint8 [N, K / 2] (N % 4 == 0, tiles: N / 4), the
// inputs in the kernel's block order; scales and zeros bf16 [N, 2, K / G]. A call is
// int4_prepare once for the activations (a few microseconds), then int4_rows over ranges
// of tiles.

// Floats of int4_prepare's per-row sums (xsum) for K inputs in groups of G.
int64_t int4_xsum_size(int64_t k, int64_t group);

// bf16 x [M, K] -> xq [M, K] (the same values in the weight's input order) and xsum
// [M, int4_xsum_size(k, group)] (per block and lane, the sum of the inputs that lane sees).
void int4_prepare(const uint16_t* x_bf16, int64_t m, int64_t k, int64_t group, uint16_t* xq_bf16, float* xsum);

// out[r, n0:n0 + 4] for r < m and the tiles t in [tile_begin, tile_end) (n0 = 4 t), bf16
// [M, N] row-major: y = x @ W.T with W = (q - 8) * scale + zero per group; on the calling
// thread only.
void int4_rows(const uint16_t* xq_bf16, int64_t m, const uint8_t* packed, const uint16_t* scales_zeros, int64_t n,
               int64_t k, int64_t group, int64_t tile_begin, int64_t tile_end, uint16_t* out_bf16,
               const float* xsum);

}  // namespace radixserve_cpu::gemv
