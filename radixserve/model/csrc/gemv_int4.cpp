// int4 group-wise weights (w = (q - 8) * s + z per group of G inputs) times bf16 activations
// at decode row counts; conventions of gemv.cpp (one fixed summation order per output,
// whatever the number of rows; the weight decoded once per tile for all rows).
//
// Layout (``pack_int4`` in cpu_gemv.py makes it at load): uint8 [N, K / 2] holding tiles
// of 4 outputs (N % 4 == 0) one after the other, each tile's bytes in the order the kernel
// reads them (one sequential stream, which the hardware prefetcher follows; four separate
// short rows it did not): per chunk of 128 inputs, the 4 outputs' 64 bytes, 16-bit lane l
// holding inputs l, l + 32, l + 64 and l + 96 (nibbles from the lowest). One 512-bit load,
// shifts by 0/4/8/12 and a mask give four vectors of 32 codes in input order, and OR-ing a
// code q into 0x4300 makes bf16(128 + q) exactly (bf16 128..255 has unit spacing). Then a
// last 64 inputs, 32 bytes per output (byte j: j and j + 32), and a last 32, 16 bytes per
// output (j and j + 16).
// So per group g, with v = 128 + q:
//
//   sum_k w x = s_g * sum_k v x + (z_g - 136 s_g) * X_g,    X_g = sum_k x   (k in g)
//
// sum v x by vdpbf16ps (exact products, float32 sums), scaled per group into a float32
// accumulator; the X_g term, once per output at the end. Scales and zeros: bf16
// [N, 2, K / G] (each output's scales, then its zeros), converted a vector at a time.

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv.h"

using namespace radixserve_cpu::gemv;

namespace {
constexpr int kMaxGroups = 1024;  // K / G per output the tile buffers hold (K up to 32768)
}  // namespace

#if RADIXSERVE_GEMV
namespace {

struct Int4Args {
  const uint8_t* packed;  // [N, K / 2]
  const uint16_t* sz;     // bf16 [N, 2, K / G]
  const uint16_t* x;      // bf16 [M, K]
  const float* xsum;      // [M, K / G]: X_g of every row
  int64_t n, k, groups;
};

// 128 inputs: (u >> 4i) & 0xF | 0x4300 (and-or in one vpternlogd: A & B | C = 0xEA).
inline void decode128(const uint8_t* p, __m512bh* v) {
  const __m512i u = _mm512_loadu_si512(p);
  const __m512i mask = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  v[0] = (__m512bh)_mm512_ternarylogic_epi32(u, mask, bias, 0xEA);
  v[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(u, 4), mask, bias, 0xEA);
  v[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(u, 8), mask, bias, 0xEA);
  v[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(u, 12), bias);
}

inline void decode64(const uint8_t* p, __m512bh& lo, __m512bh& hi) {
  const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i bias = _mm512_set1_epi16(0x4300);
  lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi16(0x000F)), bias);
  hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(u, 4), bias);
}

inline __m512bh decode32(const uint8_t* p) {
  const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i bias = _mm256_set1_epi16(0x4300);
  const __m256i lo = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi16(0x000F)), bias);
  const __m256i hi = _mm256_or_si256(_mm256_srli_epi16(u, 4), bias);
  return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// NT outputs from n0 times MT rows from m0; VPG = vectors of 32 inputs per group.
template <int NT, int MT, int VPG>
void tile(const Int4Args& a, int64_t n0, int64_t m0, const float* scale, const float* zz, float* sums) {
  const int64_t k = a.k;
  const uint8_t* base = a.packed + n0 * (k / 2);  // this tile's bytes
  __m512 y[NT][MT], d[NT][MT];
#pragma GCC unroll 4
  for (int i = 0; i < NT; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) y[i][j] = d[i][j] = _mm512_setzero_ps();

  // One vector of 32 inputs (index v) for every output of the tile.
  auto step = [&](int64_t v, const __m512bh* w) __attribute__((always_inline)) {
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(a.x + (m0 + j) * k + v * 32);
#pragma GCC unroll 4
      for (int i = 0; i < NT; ++i) d[i][j] = _mm512_dpbf16_ps(d[i][j], w[i], xv);
    }
    if ((v + 1) % VPG == 0) {  // the group ends: scale its sums into the accumulators
      const int64_t g = v / VPG;
#pragma GCC unroll 4
      for (int i = 0; i < NT; ++i) {
        const __m512 s = _mm512_set1_ps(scale[i * a.groups + g]);
#pragma GCC unroll 4
        for (int j = 0; j < MT; ++j) {
          y[i][j] = _mm512_fmadd_ps(d[i][j], s, y[i][j]);
          d[i][j] = _mm512_setzero_ps();
        }
      }
    }
  };

  const int64_t chunks = k / 128;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512bh v[NT][4];
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) decode128(base + (c * kNT + i) * 64, v[i]);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      __m512bh w[NT];
#pragma GCC unroll 4
      for (int i = 0; i < NT; ++i) w[i] = v[i][r];
      step(4 * c + r, w);
    }
  }
  int64_t v = 4 * chunks;
  const uint8_t* tail = base + chunks * kNT * 64;  // the last 64 and/or 32 inputs
  if (k % 128 >= 64) {
    __m512bh lo[NT], hi[NT];
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) decode64(tail + i * 32, lo[i], hi[i]);
    step(v, lo);
    step(v + 1, hi);
    v += 2;
    tail += kNT * 32;
  }
  if (k % 64) {
    __m512bh w[NT];
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) w[i] = decode32(tail + i * 16);
    step(v, w);
  }
  // The zero term sum_g zz_g X_g, 16 groups a vector, then one reduction per output.
#pragma GCC unroll 4
  for (int i = 0; i < NT; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) {
      __m512 acc = y[i][j];
      const float* xs = a.xsum + (m0 + j) * a.groups;
      const float* z = zz + i * a.groups;
      int64_t g = 0;
      for (; g + 16 <= a.groups; g += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(z + g), _mm512_loadu_ps(xs + g), acc);
      if (g < a.groups) {
        const __mmask16 mask = tail_mask16(a.groups - g);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, z + g), _mm512_maskz_loadu_ps(mask, xs + g), acc);
      }
      sums[(m0 + j) * kNT + i] = _mm512_reduce_add_ps(acc);
    }
}

template <int VPG>
void run(const Int4Args& a, int64_t m, uint16_t* out) {
  constexpr int kMaxRows = VPG == 1 ? 4 : 2;  // accumulators y and d: keep them in registers
  const int64_t tiles = (a.n + kNT - 1) / kNT;
  at::parallel_for(0, tiles, grain_for(a.k, 0.5), [&](int64_t begin, int64_t end) {
    std::vector<float> sums(static_cast<size_t>(m) * kNT), scale(kNT * a.groups), zz(kNT * a.groups);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNT;
      const int nt = static_cast<int>(std::min<int64_t>(kNT, a.n - n0));
      for (int i = 0; i < nt; ++i) {
        const uint16_t* s = a.sz + (n0 + i) * 2 * a.groups;
        const uint16_t* z = s + a.groups;
        for (int64_t g = 0; g < a.groups; g += 16) {
          const __mmask16 mask = a.groups - g >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask16(a.groups - g);
          const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, s + g)), 16));
          const __m512 zv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, z + g)), 16));
          _mm512_mask_storeu_ps(scale.data() + i * a.groups + g, mask, sv);
          _mm512_mask_storeu_ps(zz.data() + i * a.groups + g, mask, _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), sv, zv));
        }
      }
      for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
        const int mt = static_cast<int>(std::min<int64_t>(kMaxRows, m - m0));
        dispatch<kMaxRows>(nt, mt, [&](auto NT, auto MT) {
          tile<decltype(NT)::value, decltype(MT)::value, VPG>(a, n0, m0, scale.data(), zz.data(), sums.data());
        });
      }
      for (int64_t r = 0; r < m; ++r)
        for (int i = 0; i < nt; ++i) out[r * a.n + n0 + i] = float_to_bf16(sums[r * kNT + i]);
    }
  });
}

// X_g of every row: vdpbf16ps against ones (exact products), one reduction per group.
void group_sums(const uint16_t* x, int64_t m, int64_t k, int64_t group, float* out) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
  const int64_t groups = k / group;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + r * k + k0), ones);
      out[r * groups + g] = _mm512_reduce_add_ps(acc);
    }
}

}  // namespace
#endif  // RADIXSERVE_GEMV

// y = x @ dequant(W).T for bf16 x [M, K] and W in this file's int4 layout: bf16 y [M, N].
at::Tensor radixserve_gemv_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                                int64_t group_size) {
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
  TORCH_CHECK(k % group_size == 0 && k / group_size <= kMaxGroups, "K must be a multiple of the group size");
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.numel() == k / group_size * n * 2,
              "scales_zeros must be contiguous bfloat16 [N, 2, K / G]");
  at::Tensor y = at::empty({m, n}, x.options());
#if RADIXSERVE_GEMV
  const int64_t groups = k / group_size;
  std::vector<float> xsum(static_cast<size_t>(m * groups));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  group_sums(xp, m, k, group_size, xsum.data());
  const Int4Args a{packed.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>()),
                   xp,
                   xsum.data(),
                   n,
                   k,
                   groups};
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  switch (group_size / 32) {
    case 1: run<1>(a, m, out); break;
    case 2: run<2>(a, m, out); break;
    case 4: run<4>(a, m, out); break;
    default: run<8>(a, m, out); break;
  }
#endif
  return y;
}
