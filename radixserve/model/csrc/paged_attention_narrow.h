// The paged-attention kernel's narrow blocks on AVX-512: a decode token's few query rows
// (kNarrowRows) scored against keys transposed into the lanes. kNarrowRows is 0 without
// AVX-512 (every block takes the rows-in-lanes path of attend_run).
#pragma once

#include <algorithm>
#include <cstdint>

#include "paged_attention.h"
#include "paged_attention_pairs.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_cpu::paged {

#if defined(__AVX512F__)
// Blocks of up to this many rows (a decode token's query heads of one KV head: 1 for MHA,
// 3 for SmolLM2's GQA) take narrow_block below.
constexpr int64_t kNarrowRows = 4;

// f(std::integral_constant<int, R>{}) for R = ``rows`` (1 .. kNarrowRows): a narrow block's
// rows as a constant its loops unroll over.
template <typename F>
inline void with_narrow_rows(int64_t rows, F&& f) {
  static_assert(kNarrowRows == 4, "the cases below");
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// out[j] lane i = src[i][col + j] for i, j < 16: sixteen rows' 16 words from ``col`` on,
// transposed in registers (pairs of words, then pairs of pairs, then 128- and 256-bit
// quarters change places). Words are moved, not read as numbers: bf16 pairs pass too.
// Always inlined: a call keeps ``out`` in memory, and the caller's dot products then wait on
// stores and loads of it.
__attribute__((always_inline)) inline void transpose16(const float* const* src, int64_t col, __m512 (&out)[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(src[i] + col);
  for (int i = 0; i < 16; i += 2) {
    b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    for (int u = 0; u < 2; ++u) {
      const __m512d x = _mm512_castps_pd(b[i + u]), y = _mm512_castps_pd(b[i + u + 2]);
      a[i + 2 * u] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      a[i + 2 * u + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  for (int i = 0; i < 16; i += 8) {
    for (int u = 0; u < 4; ++u) {
      b[i + u] = _mm512_shuffle_f32x4(a[i + u], a[i + u + 4], 0x88);
      b[i + u + 4] = _mm512_shuffle_f32x4(a[i + u], a[i + u + 4], 0xdd);
    }
  }
  for (int u = 0; u < 8; ++u) {
    out[u] = _mm512_shuffle_f32x4(b[u], b[u + 8], 0x88);
    out[u + 8] = _mm512_shuffle_f32x4(b[u], b[u + 8], 0xdd);
  }
}

// kt[j * kBlock + t] = dimension j of key t (as float) for the 16 keys from ``t0`` of the
// block. float keys are transposed in place; bf16 keys as pairs of dimensions in one 32-bit
// word (half the shuffles, and the widening is a shift or a mask of the transposed word);
// other dtypes from ``kr``, the rows already converted to float.
// With ``Pairs`` (pair_scores_for), bf16 keys stay pairs: kt word j * kBlock + t holds
// dimensions 2j and 2j + 1 of key t.
template <int NC, typename KV, bool Pairs>
inline void transpose_keys(const KV* const* krow, const float* const* kr, int64_t t0, float* __restrict kt) {
  __m512 w[16];
  if constexpr (std::is_same_v<KV, c10::BFloat16> && NC % 2 == 0) {
    const float* words[16];
    for (int i = 0; i < 16; ++i) words[i] = reinterpret_cast<const float*>(krow[t0 + i]);
    for (int c = 0; c < NC / 2; ++c) {
      transpose16(words, c * kLanes, w);
      for (int j = 0; j < 16; ++j) {  // word j: dimensions 2 (16 c + j) and the one after
        if constexpr (Pairs) {
          _mm512_storeu_ps(kt + (c * kLanes + j) * kBlock + t0, w[j]);
        } else {
          const __m512i x = _mm512_castps_si512(w[j]);
          float* even = kt + (2 * (c * kLanes + j)) * kBlock + t0;
          _mm512_storeu_ps(even, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
          _mm512_storeu_ps(even + kBlock, _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536))));
        }
      }
    }
  } else {
    const float* const* rows = kr + t0;
    if constexpr (std::is_same_v<KV, float>) rows = krow + t0;
    for (int c = 0; c < NC; ++c) {
      transpose16(rows, c * kLanes, w);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(kt + (c * kLanes + j) * kBlock + t0, w[j]);
    }
  }
}

// A narrow block's scores (``sc[r][g]`` lane i: row r's score of key 16 g + i) over a
// transposed copy of its keys in ``kt`` (transpose_keys): R x kBlock / kLanes vectors of FMAs
// per dimension, from zero, in the dimensions' order; with ``Pairs``, of vdpbf16ps per pair of
// dimensions, the rows' queries ``qw`` (R rows of d / 2 bf16 pairs), the scores scaled by
// ``scale`` after.
template <int NC, int R, bool Pairs, typename KV, typename Ahead>
inline void narrow_scores(const KV* const* krow, const float* const* kr, const float* __restrict q,
                          const uint32_t* __restrict qw, float scale, float* __restrict kt,
                          vf (&sc)[R][kBlock / kLanes], Ahead&& ahead) {
  constexpr int64_t d = NC * kLanes, G = kBlock / kLanes;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = g * kLanes; t < (g + 1) * kLanes; ++t) ahead(t);
    transpose_keys<NC, KV, Pairs>(krow, kr, g * kLanes, kt);
  }
  if constexpr (Pairs) {
#if RADIXSERVE_VEC_BF16
    __m512 dot[R][G];
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) dot[r][g] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < d / 2; ++j) {
      __m512bh k[G];
      for (int g = 0; g < G; ++g) k[g] = (__m512bh)_mm512_loadu_si512(kt + j * kBlock + g * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * (d / 2) + j]));
        for (int g = 0; g < G; ++g) dot[r][g] = _mm512_dpbf16_ps(dot[r][g], qj, k[g]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) sc[r][g] = static_cast<vf>(dot[r][g]) * scale;
    }
#endif
  } else {
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < G; ++g) sc[r][g] = vf{};
    }
    for (int64_t j = 0; j < d; ++j) {
      vf k[G];
      for (int g = 0; g < G; ++g) k[g] = load_vf(kt + j * kBlock + g * kLanes);
      for (int r = 0; r < R; ++r) {
        const vf qj = splat(q[r * d + j]);
        for (int g = 0; g < G; ++g) sc[r][g] += qj * k[g];
      }
    }
  }
}

#if RADIXSERVE_VEC_BF16
// out[j] lane i = src[i][col + j] for i < 16, j < 8: sixteen rows' 8 words from ``col`` on,
// transposed in registers: a[i] takes row r(i) in its low half and row r(i) + 4 in its high
// half (r = 0, 1, 2, 3, 8, 9, 10, 11), then as transpose16 within the 128-bit quarters and
// over them. As many shuffles a word as transpose16, for half its output: two groups of
// keys' words then fit in the registers beside their accumulators
// (narrow_scores_in_registers).
__attribute__((always_inline)) inline void transpose16x8(const float* const* src, int64_t col, __m512 (&out)[8]) {
  __m512 a[8], b[8];
  for (int i = 0; i < 8; ++i) {
    const int64_t r = i < 4 ? i : i + 4;
    const __m512 lo = _mm512_castps256_ps512(_mm256_loadu_ps(src[r] + col));
    a[i] = _mm512_insertf32x8(lo, _mm256_loadu_ps(src[r + 4] + col), 1);
  }
  for (int i = 0; i < 8; i += 2) {
    b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    for (int u = 0; u < 2; ++u) {
      const __m512d x = _mm512_castps_pd(b[i + u]), y = _mm512_castps_pd(b[i + u + 2]);
      a[i + 2 * u] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      a[i + 2 * u + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  // Quarter p of a[u] (u < 4) now holds word u + 4 (p % 2) of rows 0-3 (p < 2) or 4-7, and
  // of a[u + 4] the same word of rows 8-11 or 12-15: one shuffle gathers a word's quarters.
  for (int u = 0; u < 4; ++u) {
    out[u] = _mm512_shuffle_f32x4(a[u], a[u + 4], 0x88);
    out[u + 4] = _mm512_shuffle_f32x4(a[u], a[u + 4], 0xdd);
  }
}

// The rows of ``GB`` groups of 16 keys from group ``g0`` of a block (``krow``: each key's
// row, bf16 values or fp8 codes) as 32-bit words, the transpositions' operands.
template <int GB, typename T>
inline void group_words(const T* const* krow, int64_t g0, const float* (&words)[GB][16]) {
  for (int b = 0; b < GB; ++b) {
    for (int i = 0; i < 16; ++i) words[b][i] = reinterpret_cast<const float*>(krow[(g0 + b) * kLanes + i]);
  }
}

// narrow_scores with Pairs for bf16 keys, 16 keys' pairs of dimensions transposed in
// registers (8 pairs at a time) and scored there rather than copied to ``kt`` and loaded
// back: the same chain per score (the pairs in order), so the same bits. Two groups of 16
// keys side by side, as fp8_scores: a score's chain of dependent vdpbf16ps is what makes a
// row's bits its own, so the chains must be many to hide their latency (R of them, one
// group at a time, left the products waiting on each other), and each query pair broadcast
// serves both groups. Up to three rows: 2R accumulators and two groups' 8 words in registers.
template <int NC, int R, typename Ahead>
inline void narrow_scores_in_registers(const c10::BFloat16* const* krow, const uint32_t* __restrict qw, float scale,
                                       vf (&sc)[R][kBlock / kLanes], Ahead&& ahead) {
  static_assert(R <= 3, "2R accumulators and two groups' words in registers");
  constexpr int64_t d = NC * kLanes, G = kBlock / kLanes, GB = 2;
  static_assert(G % GB == 0, "whole pairs of groups");
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const float* words[GB][16];
    group_words<GB>(krow, g0, words);
    __m512 dot[R][GB];
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < GB; ++b) dot[r][b] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < d / 2; c += 8) {
      // The groups' keys' ahead() spread over the chunks: a burst would overflow the miss queues.
      const int64_t keys = GB * kLanes, chunks = d / 16, from = g0 * kLanes;
      for (int64_t t = from + c / 8 * keys / chunks; t < from + (c / 8 + 1) * keys / chunks; ++t) ahead(t);
      __m512 w[GB][8];  // w[b][j] lane i: pair c + j of key 16 (g0 + b) + i
      for (int b = 0; b < GB; ++b) transpose16x8(words[b], c, w[b]);
      for (int j = 0; j < 8; ++j) {
        for (int r = 0; r < R; ++r) {
          const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * (d / 2) + c + j]));
          for (int b = 0; b < GB; ++b) dot[r][b] = _mm512_dpbf16_ps(dot[r][b], qj, (__m512bh)w[b][j]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < GB; ++b) sc[r][g0 + b] = static_cast<vf>(dot[r][b]) * scale;
    }
  }
}
#endif

// A narrow block's online-softmax step for its R rows, from their scores ``sc`` (sc[r][g]
// lane i: row r's score of key 16 g + i): each row's maximum, its probabilities (``ps``,
// row-major R x kBlock), their sum (in the block sum's order, paged_attention.h) and the
// rescaled state ``vm``, ``vl`` (lane r: row r's). Returns the factor alpha the rows'
// accumulators take before the block's products.
template <int R>
inline vf narrow_softmax(const vf (&sc)[R][kBlock / kLanes], vf& vm, vf& vl, float* __restrict ps) {
  constexpr int64_t G = kBlock / kLanes;
  float mx[kLanes], sum[kLanes] = {};
  store_vf(mx, vm);
  for (int r = 0; r < R; ++r) {
    vf m = sc[r][0];
    for (int g = 1; g < G; ++g) m = vmax(m, sc[r][g]);
    mx[r] = std::max(mx[r], _mm512_reduce_max_ps(static_cast<__m512>(m)));  // a maximum: any order
    const vf row_max = splat(mx[r]);
    vf part{};  // the block sum's order (paged_attention.h): keys i, 16 + i, 32 + i, 48 + i
    for (int g = 0; g < G; ++g) {
      const vf e = exp2_nonpositive(sc[r][g] - row_max);
      store_vf(ps + r * kBlock + g * kLanes, e);
      part = g == 0 ? e : part + e;
    }
    sum[r] = lane_sum(part);
  }
  const vf vmx = load_vf(mx);
  const vf alpha = exp2_nonpositive(vm - vmx);
  vm = vmx;
  vl = vl * alpha + load_vf(sum);
  return alpha;
}

#if RADIXSERVE_VEC_BF16
// acc rows [0, R) = acc * alpha + a narrow block's probabilities (``ps``, narrow_softmax's)
// times its values, as bf16 pairs (paged_attention_pairs.h); ``pair_of(j, v)`` makes key pair
// j's values pairs (value_pairs' words). Staging in ``scratch``.
template <int NC, int R, typename PairOf>
inline void narrow_value_pairs(float* __restrict acc, const vf alpha, const float* ps, Scratch& scratch,
                               PairOf&& pair_of) {
  if constexpr (R * NC <= 16) {  // every row's accumulators in registers at once
    uint16_t* pr = reinterpret_cast<uint16_t*>(scratch.pw.data());
    prob_rows_bf16<R>(ps, pr);
    accumulate_value_pairs<NC, R>(acc, alpha, pr, pair_of);
  } else {
    prob_pairs_narrow<R>(ps, scratch.pw.data());
    store_value_pairs<NC>(kBlock / 2, scratch.pv.data(), pair_of);
    accumulate_pair_rows<NC>(acc, R, alpha, scratch.pw.data(), scratch.pv.data(), kBlock / 2);
  }
}
#endif

// One full, unmasked block of kBlock keys for R <= kNarrowRows rows: the scores with the keys
// in the lanes (narrow_scores) rather than the rows, which would leave most lanes idle and
// cost a vector FMA per key and dimension. Every row's score is the same FMA chain over the
// dimensions, from zero, as attend_run's; its maximum, probabilities, their sum, the rescaled
// state and the values' products (narrow_softmax, then the products) are the same operations
// in the same order too, so a row gets the same bits on either path (a decode row here, the
// prefill row of the same position there). ``ahead(t)``: called for every key t while the
// keys are transposed (to prefetch what comes next). With ``Pairs`` the probabilities times
// the values are paged_attention_pairs.h's. Staging in ``scratch``.
template <int NC, int R, bool Pairs, typename KV, typename V, typename Ahead>
void narrow_block(const KV* const* krow, const float* const* kr, const V* const* vr, const float* __restrict q,
                  const uint32_t* __restrict qw, float scale, vf& vm, vf& vl, float* __restrict acc, Scratch& scratch,
                  Ahead&& ahead) {
  constexpr int64_t G = kBlock / kLanes;
  float* __restrict ps = scratch.ps.data();
  vf sc[R][G];
#if RADIXSERVE_VEC_BF16
  if constexpr (Pairs && R <= 3) {
    narrow_scores_in_registers<NC, R>(krow, qw, scale, sc, ahead);
  } else
#endif
  {
    narrow_scores<NC, R, Pairs>(krow, kr, q, qw, scale, scratch.kt.data(), sc, ahead);
  }
  const vf alpha = narrow_softmax<R>(sc, vm, vl, ps);
#if RADIXSERVE_VEC_BF16
  if constexpr (Pairs) {
    const auto* values = reinterpret_cast<const uint16_t* const*>(vr);
    narrow_value_pairs<NC, R>(acc, alpha, ps, scratch, [&](int64_t j, __m512i (&v)[NC]) {
      pair_values<NC>(values[2 * j], values[2 * j + 1], v);
    });
    return;
  }
#endif
  auto prob = [&](int64_t t, int64_t r) { return ps[r * kBlock + t]; };
  if constexpr (R * NC <= 16) {  // every row in one pass over the values: R * NC accumulators
    accumulate_pv<NC, R>(acc, 0, alpha, prob, vr, kBlock);
  } else {
    accumulate_rows<NC>(acc, R, alpha, prob, vr, kBlock);
  }
}
#else
constexpr int64_t kNarrowRows = 0;  // the rows-in-lanes path everywhere
#endif

}  // namespace radixserve_cpu::paged
