// int8 weight-only linear layers for the CPU: y = (x @ q.T) * scale, bf16 activations x
// [M, K], int8 codes q with one bf16 scale per output, at any row count.
//
// The weight is kept in a block layout (``pack_int8``): groups of 64 outputs, and in a group
// the codes of each pair of neighbouring inputs for its 64 outputs side by side,
//
//   packed[g, p, i, j] = q[64 g + i, 2 p + j]          ([ceil(N / 64), K / 2, 64, 2] int8)
//
// Each 32 bytes (a block of 16 outputs x one pair of inputs) decode exactly (|q| <= 127) to
// one vector in the operand order of the AVX-512 bf16 dot product (vdpbf16ps): lane i
// multiplies output i's two codes with the same two inputs of a row, broadcast to every lane. A vector of
// accumulators then holds 16 outputs of one row; nothing is summed across lanes. That
// outer-product form is what a GEMM does: each decoded weight vector serves every row of a
// register block (4 blocks x 6 rows: 24 accumulators), each broadcast input every output of
// it, with no horizontal reductions. The row-major form this replaced (one accumulator per
// output and row, 16 partial sums reduced at the end) spent about as much on those
// reductions and its loads as on the dot products.
//
// Up to kMB rows the codes are decoded in registers as they stream from memory; with more,
// each chunk of a group of blocks is decoded once into an L1-sized panel that every block of
// rows then reads. Either way output n of row m is one float32 accumulator that starts at
// zero and takes the inputs pair by pair in input order (one vdpbf16ps per pair; the panel
// path stores and reloads the exact float32 partial sums between chunks), times the scale,
// rounded once to bf16: the same bits whatever the number of rows or the block sizes, so a
// row's result does not depend on the batch it came in (the quantized engine's exactness
// tests rely on it).
//
// A group's four blocks are interleaved pair by pair so that at one row, where the kernel
// streams four blocks at a time, a thread reads one sequential stream (four separate
// 9 KB block streams, restarting every 36 KB, read ~25 % slower).
//
// Threads: at::parallel_for over blocks of 16 outputs. Built only where the compiler targets
// AVX-512 with bf16 dot products (gemv.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"

namespace {

using namespace radixserve_cpu::gemv;

constexpr int kB = 16;            // outputs per block
constexpr int kPairBytes = 32;    // one pair of inputs for a block's 16 outputs
constexpr int kGroup = 4;         // blocks interleaved pair by pair in the layout (64 outputs)
constexpr int64_t kGroupPairBytes = kGroup * kPairBytes;  // one pair of inputs for a group

#if RADIXSERVE_GEMV

constexpr int kNB = 4;            // blocks per register block (64 outputs)
constexpr int kMB = 6;            // rows per register block: kNB * kMB = 24 accumulators
constexpr int64_t kChunk = 64;    // pairs per panel chunk: 4 blocks x 64 pairs x 64 B = 16 KB
// How far ahead of its reads a thread's stream prefetches (as gemv.cpp's row streams).
constexpr int64_t kAhead = 4096;

// 32 codes (16 outputs x 2 inputs) as floats: bytes 0-15 in lo, 16-31 in hi.
inline void widen(const int8_t* src, __m512& lo, __m512& hi) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
}

// The codes as bf16, in the byte order (element e of the vector is byte e): exact.
inline __m512bh decode(const int8_t* src) {
  __m512 lo, hi;
  widen(src, lo, hi);
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// The pair of inputs (2p, 2p + 1) of a row in every 32-bit lane.
inline __m512bh broadcast_pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

// 16 bf16 scales (fewer at the last, partial block) as floats.
inline __m512 load_scales(const uint16_t* scale, int valid) {
  const __m256i s = valid == kB ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale))
                                : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << valid) - 1), scale);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
}

// out[0 : valid] = bf16(sums * scales), nearest even (gemv.h's float_to_bf16, vectorized).
inline void finish(__m512 sums, __m512 scales, uint16_t* out, int valid) {
  const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sums, scales));
  if (valid == kB)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), y);
  else  // masked stores are slow on this CPU (AMD Zen 4): only the last block's
    _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << valid) - 1), y);
}

// One step of the outer product: acc[i][r] += w[i] . (row r's pair of inputs at x), for
// the NB decoded vectors of 16 outputs and the MB rows (row r at x + r * ldx).
template <int NB, int MB>
inline void outer_step(__m512 (&acc)[NB][MB], const __m512bh (&w)[NB], const uint16_t* x, int64_t ldx) {
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r) {
    const __m512bh xv = broadcast_pair(x + r * ldx);
#pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], w[i], xv);
  }
}

// Where the weight, the rows and the outputs of one call are.
struct Call {
  const uint16_t* x;  // bf16 [m, k]
  int64_t m, k, n;
  const int8_t* packed;
  const uint16_t* scale;
  uint16_t* out;  // bf16 [m, n]
  int64_t pairs() const { return k / 2; }
  // Block b's codes for pair 0; pair p is p * kGroupPairBytes further.
  const int8_t* block(int64_t b) const {
    return packed + (b / kGroup) * pairs() * kGroupPairBytes + (b % kGroup) * kPairBytes;
  }
  int valid(int64_t b) const { return static_cast<int>(std::min<int64_t>(kB, n - b * kB)); }
};

// The NB blocks ``bs`` x the call's MB rows, every pair, the codes decoded in registers as
// they stream; then the outputs written.
template <int NB, int MB>
void register_block(const Call& c, const int64_t (&bs)[NB]) {
  __m512 acc[NB][MB];
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < MB; ++r) acc[i][r] = _mm512_setzero_ps();
  const int8_t* blk[NB];
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) blk[i] = c.block(bs[i]);
  const int64_t ldx = c.k, pairs = c.pairs();  // locals: kept in registers over the loop
  const uint16_t* x = c.x;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NB];
#pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) {
      const int8_t* src = blk[i] + p * kGroupPairBytes;
      // One prefetch per 64-byte line (two blocks' pair) of the stream; past the end of the
      // weight a prefetch does not fault.
      if (i == 0 || bs[i] != bs[i - 1] + 1 || bs[i] % 2 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(src) + kAhead, _MM_HINT_T0);
      w[i] = decode(src);
    }
    outer_step(acc, w, x + 2 * p, ldx);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i) {
    const int64_t b = bs[i];
    const __m512 s = load_scales(c.scale + b * kB, c.valid(b));
#pragma GCC unroll 8
    for (int r = 0; r < MB; ++r) finish(acc[i][r], s, c.out + r * c.n + b * kB, c.valid(b));
  }
}

// MB rows from m0 times a decoded panel of NB blocks x ``pairs`` pairs (from pair p0),
// accumulating into sums [rows, NB * 16] (from zero at the first chunk). ``ahead``: where
// the next chunk's codes start, prefetched a group's pair per pair (nullptr: none).
template <int NB, int MB>
void panel_block(const Call& c, const uint16_t* panel, int64_t p0, int64_t pairs, int64_t m0, float* sums,
                 const int8_t* ahead) {
  constexpr int64_t ld = NB * kB;
  __m512 acc[NB][MB];
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < MB; ++r)
      acc[i][r] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (m0 + r) * ld + i * kB);
  const int64_t ldx = c.k;
  const uint16_t* x = c.x + m0 * ldx + 2 * p0;
  for (int64_t p = 0; p < pairs; ++p) {
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + p * kGroupPairBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + p * kGroupPairBytes + 64), _MM_HINT_T0);
    }
    __m512bh w[NB];
#pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) w[i] = (__m512bh)_mm512_loadu_si512(panel + (i * kChunk + p) * 2 * kB);
    outer_step(acc, w, x + 2 * p, ldx);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < MB; ++r) _mm512_storeu_ps(sums + (m0 + r) * ld + i * kB, acc[i][r]);
}

// fn(integral_constant<R>) for 1 <= rows <= kMB.
template <typename Fn>
void with_rows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    default: return fn(std::integral_constant<int, kMB>{});
  }
}

// Every row times the NB blocks from b0, which lie in one group of the layout (int8_rows
// only passes such runs): the panel path reads their codes as one address-ordered stream.
template <int NB>
void blocks(const Call& c, int64_t b0, std::vector<uint16_t>& panel, std::vector<float>& sums) {
  if (c.m <= kMB) {
    int64_t bs[NB];
    for (int i = 0; i < NB; ++i) bs[i] = b0 + i;
    with_rows(c.m, [&](auto R) { register_block<NB, decltype(R)::value>(c, bs); });
    return;
  }
  constexpr int64_t ld = NB * kB;
  for (int64_t p0 = 0; p0 < c.pairs(); p0 += kChunk) {
    const int64_t pairs = std::min(kChunk, c.pairs() - p0);
    // Decode pair by pair (the group's codes in address order) into the panel.
    const int8_t* src = c.block(b0) + p0 * kGroupPairBytes;
    for (int64_t p = 0; p < pairs; ++p) {
#pragma GCC unroll 4
      for (int i = 0; i < NB; ++i)
        _mm512_storeu_si512(panel.data() + (i * kChunk + p) * 2 * kB,
                            (__m512i)decode(src + p * kGroupPairBytes + i * kPairBytes));
    }
    // The first block of rows prefetches the next chunk (or the next group's first), so that
    // its decode does not wait on memory: the hardware prefetcher does not see it coming.
    const int8_t* next = p0 + kChunk < c.pairs() ? src + kChunk * kGroupPairBytes : c.block(b0 + NB);
    for (int64_t m0 = 0; m0 < c.m; m0 += kMB)
      with_rows(std::min<int64_t>(kMB, c.m - m0), [&](auto R) {
        panel_block<NB, decltype(R)::value>(c, panel.data(), p0, pairs, m0, sums.data(), m0 == 0 ? next : nullptr);
      });
  }
  for (int i = 0; i < NB; ++i) {
    const int64_t b = b0 + i;
    const __m512 s = load_scales(c.scale + b * kB, c.valid(b));
    for (int64_t r = 0; r < c.m; ++r)
      finish(_mm512_loadu_ps(sums.data() + r * ld + i * kB), s, c.out + r * c.n + b * kB, c.valid(b));
  }
}

#endif  // RADIXSERVE_GEMV

}  // namespace

namespace radixserve_cpu::gemv {

#if RADIXSERVE_GEMV
void int8_rows(const uint16_t* x, int64_t m, const int8_t* packed, const uint16_t* scale, int64_t n, int64_t k,
               int64_t block_begin, int64_t block_end, uint16_t* out) {
  const Call c{x, m, k, n, packed, scale, out};
  std::vector<uint16_t> panel(m > kMB ? kNB * kChunk * 2 * kB : 0);
  std::vector<float> sums(m > kMB ? static_cast<size_t>(m) * kNB * kB : 0);
  int64_t b = block_begin;
  // Register blocks start on a group of the layout, so that each reads whole lines of one
  // stream: first the blocks before the range's first group (a thread's range can start
  // mid-group).
  for (; b % kGroup != 0 && b + 2 <= block_end && b % 2 == 0; b += 2) blocks<2>(c, b, panel, sums);
  for (; b % kGroup != 0 && b < block_end; ++b) blocks<1>(c, b, panel, sums);
  for (; b + kNB <= block_end; b += kNB) blocks<kNB>(c, b, panel, sums);
  for (; b + 2 <= block_end; b += 2) blocks<2>(c, b, panel, sums);
  for (; b < block_end; ++b) blocks<1>(c, b, panel, sums);
}
#else
void int8_rows(const uint16_t*, int64_t, const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
               uint16_t*) {
  TORCH_CHECK(false, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
}
#endif

}  // namespace radixserve_cpu::gemv

namespace {

using namespace radixserve_cpu::gemv;

// n and k of a packed weight for ``scale``'s n outputs: [ceil(n / 64), k / 2, 64, 2] int8.
std::pair<int64_t, int64_t> check_packed(const at::Tensor& packed, const at::Tensor& scale) {
  TORCH_CHECK(RADIXSERVE_GEMV, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.device().is_cpu() && packed.size(2) == kGroup * kB && packed.size(3) == 2,
              "packed must be a contiguous int8 [N / 64, K / 2, 64, 2] CPU tensor (cpu_gemv.pack_int8)");
  const int64_t n = scale.numel(), k = packed.size(1) * 2;
  const int64_t groups = (n + kGroup * kB - 1) / (kGroup * kB);
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kBFloat16 && packed.size(0) == groups,
              "scale must be contiguous bfloat16 [N], N / 64 rounded up the packed groups");
  return {n, k};
}

// y = (x @ q.T) * scale for bfloat16 x [M, K] and q packed by pack_int8: bf16 y [M, N].
at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  const auto [n, k] = check_packed(packed, scale);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                  x.size(1) == k,
              "x must be a contiguous [M, ", k, "] bfloat16 CPU tensor");
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
#if RADIXSERVE_GEMV
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(1, k * kB));
  at::parallel_for(0, (n + kB - 1) / kB, grain, [&](int64_t begin, int64_t end) {
    int8_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, packed.data_ptr<int8_t>(),
              reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>()), n, k, begin, end,
              reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  });
#endif
  return y;
}

#if RADIXSERVE_GEMV
// Transposes 16 vectors of 16 32-bit lanes in place: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

// The dense path's weight: bf16 w[n, k] = bf16(q[n, k] * scale[n]) from the packed codes, in
// one pass. A code times a bf16 scale is exact in float32, so its one rounding (nearest
// even) gives torch's ``q.to(bf16) * scale[:, None]`` bit for bit. Per block, 16 pairs
// decode to 16 vectors (lane i: output i's two inputs) that one in-register transpose turns
// into 16 rows of 32 inputs each.
at::Tensor int8_dequantize(const at::Tensor& packed, const at::Tensor& scale) {
  const auto [n, k] = check_packed(packed, scale);
  at::Tensor w = at::empty({n, k}, packed.options().dtype(at::kBFloat16));
#if RADIXSERVE_GEMV
  const int8_t* qp = packed.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  uint16_t* wp = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t pairs = k / 2;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(1, k * kB));
  at::parallel_for(0, (n + kB - 1) / kB, grain, [&](int64_t begin, int64_t end) {
    // Element e of a decoded vector is output e / 2 (lo: outputs 0-7, hi: 8-15).
    const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    for (int64_t b = begin; b < end; ++b) {
      const int valid = static_cast<int>(std::min<int64_t>(kB, n - b * kB));
      const __m512 s = load_scales(sp + b * kB, valid);
      const __m512 s_lo = _mm512_permutexvar_ps(lo_idx, s), s_hi = _mm512_permutexvar_ps(hi_idx, s);
      const int8_t* src = qp + (b / kGroup) * pairs * kGroupPairBytes + (b % kGroup) * kPairBytes;
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const int np = static_cast<int>(std::min<int64_t>(16, pairs - p0));
        __m512i v[16];
        for (int p = 0; p < 16; ++p) {
          if (p < np) {
            __m512 lo, hi;
            widen(src + (p0 + p) * kGroupPairBytes, lo, hi);
            v[p] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s_hi), _mm512_mul_ps(lo, s_lo));
          } else {
            v[p] = _mm512_setzero_si512();
          }
        }
        transpose16(v);
        for (int i = 0; i < valid; ++i) {
          uint16_t* dst = wp + (b * kB + i) * k + 2 * p0;
          if (np == 16)  // masked stores are slow on this CPU (AMD Zen 4): only the tail's
            _mm512_storeu_si512(dst, v[i]);
          else
            _mm512_mask_storeu_epi32(dst, static_cast<__mmask16>((1u << np) - 1), v[i]);
        }
      }
    }
  });
#endif
  return w;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("gemv_int8(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.impl("gemv_int8", c10::DispatchKey::CPU, &gemv_int8);
  m.def("int8_dequantize(Tensor packed, Tensor scale) -> Tensor");
  m.impl("int8_dequantize", c10::DispatchKey::CPU, &int8_dequantize);
}
