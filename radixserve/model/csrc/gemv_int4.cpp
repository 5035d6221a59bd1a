// int4 group-wise weights (w = (q - 8) * s + z per group of G inputs) times bf16 activations
// at decode row counts; conventions of gemv.cpp (one fixed summation order per output,
// whatever the number of rows or the split over threads; the weight decoded once per tile
// for every row).
//
// Codes. A nibble q OR-ed into 0x4300 is bf16(128 + q) exactly (bf16 128..255 has unit
// spacing), so vdpbf16ps multiplies codes and activations exactly, float32 sums. Per group g,
// with v = 128 + q and X_g = sum of the row's x over g:
//
//   sum_k w x = s_g * sum_k v x + (z_g - 136 s_g) * X_g
//
// Block order. Scaling the sums per group would cost one FMA per group per output; with
// G = 32 that is one per vdpbf16ps, half the kernel's arithmetic. Instead the inputs are
// reordered (at load for the weight, per call for the activations) so that each float lane
// of the dot products stays on one group: a block of B groups (16 while 16 are left, then
// 8, 4, 2, 1 from the rest) gives each group 16 / B lanes, and vector j of the block holds,
// in lane l (inputs 2l, 2l + 1 of the vector), the group g0 + l / R inputs
// 2 (j R + l % R) and + 1, R = 16 / B. A block's G B / 32 vectors accumulate into one
// register per output (two, even and odd vectors, for latency), and once per block
//
//   y += (d_even + d_odd) * s_lanes + (z - 136 s)_lanes * X_lanes
//
// with the scales and zeros spread to the lanes by one permute and X_lanes the sums of the
// row's inputs each lane saw (int4_prepare). B = 1 is the plain order.
//
// Layout (``pack_int4`` in cpu_gemv.py makes it at load): uint8 [N, K / 2] holding tiles of
// 4 outputs (N % 4 == 0) one after the other, each tile's bytes in the order the kernel reads
// them (one sequential stream): over the vectors in block order, per chunk of 4 vectors (128
// inputs) the 4 outputs' 64 bytes, 16-bit lane l holding element l of the chunk's 4 vectors
// (nibbles from the lowest): one 512-bit load, shifts by 0/4/8/12 and a mask give the four
// vectors. Then a last 2 vectors, 32 bytes per output (byte j: element j of each), and a last
// 1, 16 bytes per output (elements j and j + 16). Blocks of 4 vectors or more come first and
// have a multiple of 4, so chunks never straddle blocks. Scales and zeros: bf16 [N, 2, K / G]
// (each output's scales, then its zeros), in group order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv.h"

namespace radixserve_cpu::gemv {

namespace {

constexpr int kLanes = 16;      // float lanes of a dot product: groups of a full block
// Rows per tile: 2 accumulators x 4 outputs x rows + y in registers. From 2 rows the kernel
// is bound by its dot products (one vdpbf16ps per 32 codes per row); 4 rows a pass (over 2
// outputs at a time) measured no faster at 4-16 rows (2-core VM, 2026-12-02).
constexpr int kMaxRowsInt4 = 2;
// Tiles ahead the codes (and scales) are prefetched. The stream is sequential, yet software
// prefetch still helped at 1 row: 23 GB/s without, 26 at 2 tiles, 29 at 4 on one thread over
// 30 SmolLM2 layers (2-core VM, 2026-12-02; about equal at 2-4 rows).
constexpr int64_t kPrefetchTiles = 4;

// Blocks of groups: fn(g0, B) for groups/16 blocks of 16, then the remainder's bits (8, 4, 2, 1).
template <typename Fn>
inline void for_each_block(int64_t groups, Fn&& fn) {
  int64_t g0 = 0;
  for (; g0 + kLanes <= groups; g0 += kLanes) fn(g0, kLanes);
  for (int b = kLanes / 2; b >= 1; b /= 2)
    if (groups - g0 >= b) {
      fn(g0, b);
      g0 += b;
    }
}

inline int64_t num_blocks(int64_t groups) {
  return groups / kLanes + __builtin_popcountll(static_cast<unsigned long long>(groups % kLanes));
}

inline int log2_int(int b) { return 31 - __builtin_clz(static_cast<unsigned>(b)); }

}  // namespace

int64_t int4_xsum_size(int64_t k, int64_t group) { return num_blocks(k / group) * kLanes; }

#if RADIXSERVE_GEMV
namespace {

// 128 inputs: (u >> 4i) & 0xF | 0x4300 (and-or in one vpternlogd: A & B | C = 0xEA).
inline void decode128(const uint8_t* p, __m512bh* v) {
  const __m512i u = _mm512_loadu_si512(p);
  const __m512i mask = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  v[0] = (__m512bh)_mm512_ternarylogic_epi32(u, mask, bias, 0xEA);
  v[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(u, 4), mask, bias, 0xEA);
  v[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(u, 8), mask, bias, 0xEA);
  v[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(u, 12), bias);
}

inline void decode64(const uint8_t* p, __m512bh* v) {
  const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mask = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  v[0] = (__m512bh)_mm512_ternarylogic_epi32(u, mask, bias, 0xEA);
  v[1] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(u, 4), bias);
}

inline __m512bh decode32(const uint8_t* p) {
  const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i bias = _mm256_set1_epi16(0x4300);
  const __m256i lo = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi16(0x000F)), bias);
  const __m256i hi = _mm256_or_si256(_mm256_srli_epi16(u, 4), bias);
  return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// B bf16 values as floats in lanes 0..B-1, then spread: lane l gets value l >> shift.
inline __m512 spread_bf16(const uint16_t* p, int b, __m512i idx) {
  const __mmask16 mask = static_cast<__mmask16>((1u << b) - 1);
  const __m512 v =
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
  return b == kLanes ? v : _mm512_permutexvar_ps(idx, v);
}

// The 16-lane sums of a, b, c, d in lanes 0..3: the same tree for each of them.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}

struct Int4Call {
  const uint8_t* packed;  // [N, K / 2], pack_int4's layout
  const uint16_t* sz;     // bf16 [N, 2, K / G]
  const uint16_t* xq;     // bf16 [M, K], block order
  const float* xsum;      // [M, xsum_size]
  uint16_t* out;          // bf16 [M, N]
  int64_t n, k, group, groups, xsum_size;
};

// The 4 outputs of tile t times MT rows from m0.
template <int MT>
void tile(const Int4Call& a, int64_t t, int64_t m0) {
  const int64_t k = a.k, tile_bytes = kNT * k / 2;
  const uint8_t* p = a.packed + t * tile_bytes;  // this tile's bytes, read in order
  const int64_t ahead = kPrefetchTiles * tile_bytes;
  const bool prefetch = m0 == 0;  // later rows find the tile in cache
  const uint16_t* sz = a.sz + t * kNT * 2 * a.groups;
  if (prefetch) {  // the scales of the tile as far ahead (16 G bytes a tile)
    const char* s = reinterpret_cast<const char*>(sz + kPrefetchTiles * kNT * 2 * a.groups);
    for (int64_t off = 0; off < kNT * 2 * a.groups * 2; off += 64) _mm_prefetch(s + off, _MM_HINT_T0);
  }
  const uint16_t* x[MT];
  const float* xs[MT];
#pragma GCC unroll 2
  for (int j = 0; j < MT; ++j) {
    x[j] = a.xq + (m0 + j) * k;
    xs[j] = a.xsum + (m0 + j) * a.xsum_size;
  }
  __m512 y[kNT][MT];
#pragma GCC unroll 4
  for (int i = 0; i < kNT; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < MT; ++j) y[i][j] = _mm512_setzero_ps();
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t v = 0;    // vectors of 32 inputs done
  int64_t blk = 0;  // blocks done
  for_each_block(a.groups, [&](int64_t g0, int b) __attribute__((always_inline)) {
    __m512 d[2][kNT][MT];
#pragma GCC unroll 4
    for (int i = 0; i < kNT; ++i)
#pragma GCC unroll 2
      for (int j = 0; j < MT; ++j) d[0][i][j] = d[1][i][j] = _mm512_setzero_ps();
    // Vector number r of a chunk goes to accumulator r % 2: chunks start blocks' even vectors.
    auto dot = [&](int i, int r, int64_t vv, __m512bh w) __attribute__((always_inline)) {
#pragma GCC unroll 2
      for (int j = 0; j < MT; ++j)
        d[r & 1][i][j] = _mm512_dpbf16_ps(d[r & 1][i][j], w, (__m512bh)_mm512_loadu_si512(x[j] + vv * 32));
    };
    const int64_t nvec = a.group * b / 32;
    if (nvec >= 4) {
      for (int64_t c = 0; c < nvec / 4; ++c, v += 4, p += kNT * 64) {
        if (prefetch)
#pragma GCC unroll 4
          for (int q = 0; q < kNT; ++q) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + q * 64), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int i = 0; i < kNT; ++i) {
          __m512bh w[4];
          decode128(p + i * 64, w);
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) dot(i, r, v + r, w[r]);
        }
      }
    } else if (nvec == 2) {
      if (prefetch)
#pragma GCC unroll 2
        for (int q = 0; q < 2; ++q) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + q * 64), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int i = 0; i < kNT; ++i) {
        __m512bh w[2];
        decode64(p + i * 32, w);
        dot(i, 0, v, w[0]);
        dot(i, 1, v + 1, w[1]);
      }
      v += 2;
      p += kNT * 32;
    } else {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int i = 0; i < kNT; ++i) dot(i, 0, v, decode32(p + i * 16));
      v += 1;
      p += kNT * 16;
    }
    // The block's scales and zeros, spread to the lanes, applied once.
    const __m512i idx = _mm512_srli_epi32(iota, 4 - log2_int(b));
#pragma GCC unroll 4
    for (int i = 0; i < kNT; ++i) {
      const uint16_t* si = sz + i * 2 * a.groups + g0;
      const __m512 s = spread_bf16(si, b, idx);
      const __m512 zz = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), s, spread_bf16(si + a.groups, b, idx));
#pragma GCC unroll 2
      for (int j = 0; j < MT; ++j) {
        const __m512 acc = _mm512_fmadd_ps(_mm512_add_ps(d[0][i][j], d[1][i][j]), s, y[i][j]);
        y[i][j] = _mm512_fmadd_ps(zz, _mm512_loadu_ps(xs[j] + blk * kLanes), acc);
      }
    }
    ++blk;
  });
#pragma GCC unroll 2
  for (int j = 0; j < MT; ++j) {
    const __m128bh r = _mm_cvtneps_pbh(hsum4(y[0][j], y[1][j], y[2][j], y[3][j]));  // round to nearest even
    _mm_storel_epi64(reinterpret_cast<__m128i*>(a.out + (m0 + j) * a.n + t * kNT), (__m128i)r);
  }
}

}  // namespace

void int4_prepare(const uint16_t* x_bf16, int64_t m, int64_t k, int64_t group, uint16_t* xq_bf16, float* xsum) {
  // Inputs move in pairs (a vector's lane): 32-bit gathers.
  const int64_t groups = k / group, xsum_size = int4_xsum_size(k, group);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
  for (int64_t r = 0; r < m; ++r) {
    const int32_t* src = reinterpret_cast<const int32_t*>(x_bf16 + r * k);
    int32_t* dst = reinterpret_cast<int32_t*>(xq_bf16 + r * k);
    float* xs = xsum + r * xsum_size;
    int64_t v = 0;
    for_each_block(groups, [&](int64_t g0, int b) {
      const int shift = 4 - log2_int(b), lanes_per_group = kLanes / b;  // R
      // Pair index of lane l, vector 0: (g0 + l / R) G / 2 + l % R; vector j adds j R.
      const __m512i base = _mm512_add_epi32(
          _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(g0)), _mm512_srli_epi32(iota, shift)),
                             _mm512_set1_epi32(static_cast<int32_t>(group / 2))),
          _mm512_and_si512(iota, _mm512_set1_epi32(lanes_per_group - 1)));
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < group * b / 32; ++j, ++v) {
        const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(static_cast<int32_t>(j * lanes_per_group)));
        const __m512i pairs = _mm512_i32gather_epi32(idx, src, 4);
        _mm512_storeu_si512(dst + v * kLanes, pairs);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)pairs, ones);  // exact products, fixed order
      }
      _mm512_storeu_ps(xs, acc);
      xs += kLanes;
    });
  }
}

void int4_rows(const uint16_t* xq_bf16, int64_t m, const uint8_t* packed, const uint16_t* scales_zeros, int64_t n,
               int64_t k, int64_t group, int64_t tile_begin, int64_t tile_end, uint16_t* out_bf16,
               const float* xsum) {
  const Int4Call a{packed, scales_zeros, xq_bf16, xsum, out_bf16, n, k, group, k / group, int4_xsum_size(k, group)};
  for (int64_t t = tile_begin; t < tile_end; ++t)
    for (int64_t m0 = 0; m0 < m; m0 += kMaxRowsInt4) {
      if (m - m0 >= 2)
        tile<2>(a, t, m0);
      else
        tile<1>(a, t, m0);
    }
}

#else  // !RADIXSERVE_GEMV

void int4_prepare(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, float*) {
  TORCH_CHECK(false, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
}

void int4_rows(const uint16_t*, int64_t, const uint8_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
               uint16_t*, const float*) {
  TORCH_CHECK(false, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
}

#endif  // RADIXSERVE_GEMV

}  // namespace radixserve_cpu::gemv

// y = x @ dequant(W).T for bf16 x [M, K] and W in this file's int4 layout: bf16 y [M, N].
at::Tensor radixserve_gemv_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                                int64_t group_size) {
  using namespace radixserve_cpu::gemv;
  TORCH_CHECK(RADIXSERVE_GEMV, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed must be contiguous uint8 [N, K / 2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2, m = x.size(0);
  TORCH_CHECK(n % 4 == 0, "int4 gemv needs N divisible by 4 (its tiles), got ", n);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                  x.size(1) == k,
              "x must be a contiguous bfloat16 [M, ", k, "] CPU tensor");
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256,
              "group size must be 32, 64, 128 or 256");
  TORCH_CHECK(k % group_size == 0, "K must be a multiple of the group size");
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.numel() == k / group_size * n * 2,
              "scales_zeros must be contiguous bfloat16 [N, 2, K / G]");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  at::Tensor xq = at::empty({m, k}, x.options());
  at::Tensor xsum = at::empty({m, int4_xsum_size(k, group_size)}, x.options().dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* xqp = reinterpret_cast<uint16_t*>(xq.data_ptr<at::BFloat16>());
  int4_prepare(xp, m, k, group_size, xqp, xsum.data_ptr<float>());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* xsp = xsum.data_ptr<float>();
#if RADIXSERVE_GEMV
  at::parallel_for(0, n / kNT, grain_for(k, 0.5), [&](int64_t begin, int64_t end) {
    int4_rows(xqp, m, pp, szp, n, k, group_size, begin, end, out, xsp);
  });
#endif
  return y;
}

namespace radixserve_cpu::gemv {
namespace {

// order[p]: the input at stream position 2p of a weight with K inputs in groups of G
// (cpu_gemv.int4_input_order; 2p + 1 is its neighbour): lane l of vector j of a block of B
// groups from g0 takes inputs 2 (j R + l % R) and + 1 of group g0 + l / R, R = 16 / B.
std::vector<int32_t> stream_pair_inputs(int64_t k, int64_t group_size) {
  std::vector<int32_t> order(static_cast<size_t>(k / 2));
  int64_t pos = 0;
  for_each_block(k / group_size, [&](int64_t g0, int b) {
    const int64_t r = kLanes / b;
    for (int64_t j = 0; j < group_size * b / 32; ++j)
      for (int64_t l = 0; l < kLanes; ++l)
        order[pos++] = static_cast<int32_t>((g0 + l / r) * group_size + (j * r + l % r) * 2);
  });
  return order;
}

// Visit every code of a weight in this file's layout, two at a time: emit(row n, input index i
// (even), code of input i, code of input i + 1). Inputs 2l and 2l + 1 are always neighbours in
// the stream too (a lane of a dot product takes a pair). The rows of a tile are visited by one
// thread, tiles split over threads; a scalar pass through the stream-order table.
template <typename Emit>
void for_each_code_pair(const at::Tensor& packed, int64_t group_size, Emit&& emit) {
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  constexpr int64_t kTile = 4;  // outputs per tile (kNT)
  const std::vector<int32_t> order = stream_pair_inputs(k, group_size);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const int64_t chunks = k / 128, has64 = k % 128 >= 64, has32 = k % 64 != 0;
  at::parallel_for(0, n / kTile, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile_bytes = src + t * kTile * (k / 2);
      for (int64_t i = 0; i < kTile; ++i) {
        const int64_t row = t * kTile + i;
        for (int64_t c = 0; c < chunks; ++c) {  // 16-bit lane e: element e of vectors 4c .. 4c + 3
          const uint8_t* b = tile_bytes + (c * kTile + i) * 64;
          for (int64_t e = 0; e < 32; e += 2) {
            const uint32_t u0 = b[2 * e] | static_cast<uint32_t>(b[2 * e + 1]) << 8;
            const uint32_t u1 = b[2 * e + 2] | static_cast<uint32_t>(b[2 * e + 3]) << 8;
            for (int64_t q = 0; q < 4; ++q)
              emit(row, order[((4 * c + q) * 32 + e) / 2], (u0 >> (4 * q)) & 0xF, (u1 >> (4 * q)) & 0xF);
          }
        }
        const uint8_t* tail = tile_bytes + chunks * kTile * 64;
        int64_t pos = chunks * 128;
        if (has64) {  // byte e: element e of the two vectors
          const uint8_t* t64 = tail + i * 32;
          for (int64_t e = 0; e < 32; e += 2) {
            emit(row, order[(pos + e) / 2], t64[e] & 0xF, t64[e + 1] & 0xF);
            emit(row, order[(pos + 32 + e) / 2], t64[e] >> 4, t64[e + 1] >> 4);
          }
          tail += kTile * 32;
          pos += 64;
        }
        if (has32) {  // byte e: elements e and e + 16
          const uint8_t* t32 = tail + i * 16;
          for (int64_t e = 0; e < 16; e += 2) {
            emit(row, order[(pos + e) / 2], t32[e] & 0xF, t32[e + 1] & 0xF);
            emit(row, order[(pos + 16 + e) / 2], t32[e] >> 4, t32[e + 1] >> 4);
          }
        }
      }
    }
  });
}

void check_layout(const at::Tensor& packed, int64_t group_size) {
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.device().is_cpu(),
              "packed must be contiguous uint8 [N, K / 2] on the CPU");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(n % 4 == 0 && group_size % 32 == 0 && k % group_size == 0, "not an int4 gemv layout: N ", n,
              ", K ", k, ", group ", group_size);
}

}  // namespace
}  // namespace radixserve_cpu::gemv

// The codes uint8 [N, K] (input order) of a weight in this file's layout.
at::Tensor radixserve_gemv_int4_unpack(const at::Tensor& packed, int64_t group_size) {
  using namespace radixserve_cpu::gemv;
  check_layout(packed, group_size);
  const int64_t k = packed.size(1) * 2;
  at::Tensor codes = at::empty({packed.size(0), k}, packed.options());
  uint8_t* dst = codes.data_ptr<uint8_t>();
  for_each_code_pair(packed, group_size, [&](int64_t row, int32_t idx, uint32_t q0, uint32_t q1) {
    dst[row * k + idx] = static_cast<uint8_t>(q0);
    dst[row * k + idx + 1] = static_cast<uint8_t>(q1);
  });
  return codes;
}

// The weight bf16 [N, K] (input order): bf16((q - 8) * s + z) per code, from the layout and its
// scales and zeros (bf16 [N, 2, K / G]): the dense prefill path's decode (unpacking, then
// torch's float32 decode, took ~9x as long). Per output, into an L1 buffer in stream order with
// the kernel's own decode (bf16 128 + q) and per-lane scales, then to input order one 32-bit
// pair (two neighbouring inputs) at a time by a gather. (q - 8) * s is exact in float32 (a 4-bit
// integer times an 8-bit mantissa), so the FMA rounds once, like torch's multiply-then-add,
// then once to bf16 (nearest even): the bits of formats.dequantize_int4.
at::Tensor radixserve_gemv_int4_dequantize(const at::Tensor& packed, const at::Tensor& scales_zeros,
                                           int64_t group_size) {
  using namespace radixserve_cpu::gemv;
  TORCH_CHECK(RADIXSERVE_GEMV, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
  check_layout(packed, group_size);
  const int64_t n = packed.size(0), k = packed.size(1) * 2, groups = k / group_size;
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.numel() == groups * n * 2,
              "scales_zeros must be contiguous bfloat16 [N, 2, K / G]");
  at::Tensor w = at::empty({n, k}, scales_zeros.options());
#if RADIXSERVE_GEMV
  // Per input pair: the stream pair it comes from (the inverse of stream_pair_inputs); per
  // stream vector (32 inputs): its block.
  const int64_t nvec = k / 32;
  std::vector<int32_t> source(static_cast<size_t>(k / 2)), vec_block(static_cast<size_t>(nvec));
  {
    const std::vector<int32_t> order = stream_pair_inputs(k, group_size);
    for (int64_t p = 0; p < k / 2; ++p) source[order[p] / 2] = static_cast<int32_t>(p);
  }
  std::vector<std::pair<int64_t, int>> blocks;  // (first group, groups) in stream order
  {
    int64_t v = 0;
    for_each_block(groups, [&](int64_t g0, int b) {
      for (int64_t j = 0; j < group_size * b / 32; ++j) vec_block[v++] = static_cast<int32_t>(blocks.size());
      blocks.emplace_back(g0, b);
    });
  }
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const auto* sz = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t chunks = k / 128, has64 = k % 128 >= 64, has32 = k % 64 != 0;
  at::parallel_for(0, n / kNT, 16, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> vecs(static_cast<size_t>(nvec));  // one output, stream order
    std::vector<__m512> lanes(blocks.size() * 2);        // per block: scales, zeros
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // After cvtne2ps(odd, even): even results in 0..15, odd in 16..31; element order interleaves them.
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    const __m512 offset = _mm512_set1_ps(136.0f);  // 128 + q - 136 = q - 8, exactly
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile_bytes = src + t * kNT * (k / 2);
      for (int64_t i = 0; i < kNT; ++i) {
        const int64_t row = t * kNT + i;
        const uint16_t* scales = sz + row * 2 * groups;
        for (size_t b = 0; b < blocks.size(); ++b) {
          const auto [g0, nb] = blocks[b];
          const __m512i idx = _mm512_srli_epi32(iota, 4 - log2_int(nb));
          lanes[2 * b] = spread_bf16(scales + g0, nb, idx);
          lanes[2 * b + 1] = spread_bf16(scales + groups + g0, nb, idx);
        }
        for (int64_t c = 0; c < chunks; ++c) decode128(tile_bytes + (c * kNT + i) * 64, vecs.data() + 4 * c);
        const uint8_t* tail = tile_bytes + chunks * kNT * 64;
        if (has64) {
          decode64(tail + i * 32, vecs.data() + 4 * chunks);
          tail += kNT * 32;
        }
        if (has32) vecs[nvec - 1] = decode32(tail + i * 16);
        for (int64_t v = 0; v < nvec; ++v) {
          const __m512i u = (__m512i)vecs[v];
          const __m512 s = lanes[2 * vec_block[v]], z = lanes[2 * vec_block[v] + 1];
          const __m512 even = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)), offset);
          const __m512 odd = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_and_si512(u, high)), offset);
          vecs[v] = (__m512bh)_mm512_permutexvar_epi16(
              interleave, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(odd, s, z), _mm512_fmadd_ps(even, s, z)));
        }
        const int* from = reinterpret_cast<const int*>(vecs.data());
        uint16_t* out = dst + row * k;
        for (int64_t j = 0; j < k / 2; j += kLanes)
          _mm512_storeu_si512(out + 2 * j,
                              _mm512_i32gather_epi32(_mm512_loadu_si512(source.data() + j), from, 4));
      }
    }
  });
#endif
  return w;
}
