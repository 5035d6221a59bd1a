// int4 group-wise weights (w = (q - 8) * s + z per group of G inputs) times bf16 activations
// at decode row counts; conventions of gemv.cpp (one fixed summation order per output,
// whatever the number of rows; the weight decoded once per tile for all rows).
//
// Layout (``pack_int4`` in cpu_gemv.py makes it at load): uint8 [N, K / 2], each output's
// codes in chunks of 64 inputs, byte j of a chunk holding input j (low nibble) and input
// j + 32 (high nibble); a last chunk of 32 inputs pairs j and j + 16. One 256-bit load,
// a widening to 16-bit lanes, a mask and a shift give two vectors of 32 codes in input
// order, and OR-ing a code q into 0x4300 makes bf16(128 + q) exactly (bf16 128..255 has
// unit spacing). So per group g, with v = 128 + q:
//
//   sum_k w x = s_g * sum_k v x + (z_g - 136 s_g) * X_g,    X_g = sum_k x   (k in g)
//
// sum v x by vdpbf16ps (exact products, float32 sums), scaled per group into a float32
// accumulator; the X_g term, once per output at the end. The scales and zeros are read in
// the tinygemm layout the layer keeps anyway (bf16 [K / G, N, 2]).

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv.h"

using namespace radixserve_cpu::gemv;

#if RADIXSERVE_GEMV
namespace {

constexpr int kMaxGroups = 1024;  // K / G per output the tile buffers hold (K up to 32768)

struct Int4Args {
  const uint8_t* packed;  // [N, K / 2]
  const uint16_t* sz;     // bf16 [K / G, N, 2]
  const uint16_t* x;      // bf16 [M, K]
  const float* xsum;      // [M, K / G]: X_g of every row
  int64_t n, k, groups;
};

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
  const int64_t k = a.k, ldp = k / 2;
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

  const int64_t chunks = k / 64;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512bh lo[NT], hi[NT];
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) decode64(a.packed + (n0 + i) * ldp + c * 32, lo[i], hi[i]);
    step(2 * c, lo);
    step(2 * c + 1, hi);
  }
  if (k % 64) {
    __m512bh w[NT];
#pragma GCC unroll 4
    for (int i = 0; i < NT; ++i) w[i] = decode32(a.packed + (n0 + i) * ldp + chunks * 32);
    step(2 * chunks, w);
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
      for (int i = 0; i < nt; ++i)
        for (int64_t g = 0; g < a.groups; ++g) {
          const uint16_t* p = a.sz + (g * a.n + n0 + i) * 2;
          const float s = bf16_to_float(p[0]), z = bf16_to_float(p[1]);
          scale[i * a.groups + g] = s;
          zz[i * a.groups + g] = z - 136.0f * s;
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
at::Tensor radixserve_gemv_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                                int64_t group_size) {
  TORCH_CHECK(RADIXSERVE_GEMV, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed must be contiguous uint8 [N, K / 2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2, m = x.size(0);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                  x.size(1) == k,
              "x must be a contiguous bfloat16 [M, ", k, "] CPU tensor");
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256,
              "group size must be 32, 64, 128 or 256");
  TORCH_CHECK(k % group_size == 0 && k / group_size <= kMaxGroups, "K must be a multiple of the group size");
  TORCH_CHECK(scales_and_zeros.is_contiguous() && scales_and_zeros.scalar_type() == at::kBFloat16 &&
                  scales_and_zeros.numel() == k / group_size * n * 2,
              "scales_and_zeros must be contiguous bfloat16 [K / G, N, 2]");
  at::Tensor y = at::empty({m, n}, x.options());
#if RADIXSERVE_GEMV
  const int64_t groups = k / group_size;
  std::vector<float> xsum(static_cast<size_t>(m * groups));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  group_sums(xp, m, k, group_size, xsum.data());
  const Int4Args a{packed.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr<at::BFloat16>()),
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
