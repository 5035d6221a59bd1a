// The paged-attention kernel's narrow blocks over fp8 pages at scale 1 (fp8's default), for
// bf16 queries on AVX-512 BF16 and VBMI without AMX: a decode token's few query heads read
// the codes where they lie, and the keys and values become bf16 pairs in registers, as the
// narrow blocks over bf16 pages use them (paged_attention_narrow.h).
//
// Why: the other quantized blocks are decoded into a per-thread tile of bf16 rows first
// (paged_attention_quant.h), then attended as bf16 pages: a store and a load of every value,
// and the bf16 keys' two transpositions per 16 keys of 64 dimensions, on top of the decoding.
// That made a decode step over fp8 pages slower than over bf16 pages, whose bytes it halves
// (benchmarks/long_context.md). Here 16 keys' 64 codes each take one transposition of 32-bit
// words, and a byte shuffle and Fp8Bytes' table make each word's four codes two bf16 pairs;
// two keys' values are interleaved as bytes before the table makes them pairs of keys.
//
// The bits: every code becomes its exact bf16 value, as decode_keys makes it, and every
// product and sum is narrow_block's over those values, in its order (the pairs of dimensions
// in order from zero for a score, the pairs of keys in order for an output), so a block
// read here gives the bits of the same block decoded into the tile (and of bf16 pages that
// hold the decoded values: tests/model/test_native_quant_attention.py).
#pragma once

#include <cstdint>

#include "paged_attention.h"
#include "paged_attention_narrow.h"
#include "paged_attention_pairs.h"
#include "paged_attention_quant.h"

#if RADIXSERVE_FP8_BYTES
#include <immintrin.h>
#endif

namespace radixserve_cpu::paged {

// fp8 pages a narrow block reads in place (attend_run, Scratch::fp8): the codes as pages of
// one-byte elements, the run's pages, the KV head, and the codes' table.
struct Fp8Narrow {
  Layer<uint8_t> codes;
  const int64_t* pages;
  int64_t h;
#if RADIXSERVE_FP8_BYTES
  const Fp8Bytes* table;
#endif
};

// Whether attend_run's narrow blocks of head size NC * kLanes read fp8 pages in place where
// Scratch::fp8 is set: bf16 pairs (``Pairs``) and whole 64-byte rows of codes.
template <int NC, bool Pairs>
constexpr bool kFp8InPlace = RADIXSERVE_FP8_BYTES && Pairs && NC % 4 == 0;

#if RADIXSERVE_FP8_BYTES
// R rows' scores (``qw``: R x d / 2 bf16 pairs, ``sc`` as narrow_scores') over the kBlock keys
// whose code rows are ``krow``: per 16 keys and 64 dimensions, one transposition of 32-bit
// words (w[j] lane i: codes 4j .. 4j + 3 of key i), then per word a byte shuffle within
// 128-bit lanes (keys 4l .. 4l + 3's codes 4j, 4j + 1 to the low 8 bytes of lane l, 4j + 2,
// 4j + 3 to the high 8) and the table: pair 2j of the 16 keys, then pair 2j + 1, each scored
// at once by every row (vdpbf16ps, the pairs in order from zero, as narrow_scores_in_registers).
// Several groups of 16 keys side by side (GB): a score's chain of dependent vdpbf16ps is
// the order that makes a row's bits its own, so the chains must be many to hide their latency
// (R of them, one group at a time, left the products waiting on each other), and each
// query pair broadcast serves every group.
template <int NC, int R, typename Ahead>
inline void fp8_scores(const uint8_t* const* krow, const Fp8Bytes& table, const uint32_t* __restrict qw, float scale,
                       vf (&sc)[R][kBlock / kLanes], Ahead&& ahead) {
  static_assert(NC % 4 == 0 && R <= kNarrowRows, "64 codes a row part; a narrow block's rows");
  constexpr int64_t d = NC * kLanes, G = kBlock / kLanes;
  constexpr int GB = R <= 2 ? 4 : 2;  // groups at a time: 2R-8 chains, and registers for them
  const __m512i split = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  for (int g0 = 0; g0 < G; g0 += GB) {
    const float* words[GB][16];
    group_words<GB>(krow, g0, words);
    __m512 dot[R][GB];
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < GB; ++b) dot[r][b] = _mm512_setzero_ps();
    }
    for (int c = 0; c < NC / 4; ++c) {
      __m512 w[GB][16];
      for (int b = 0; b < GB; ++b) {
        if (c == 0) {
          for (int64_t t = (g0 + b) * kLanes; t < (g0 + b + 1) * kLanes; ++t) ahead(t);
        }
        transpose16(words[b], c * kLanes, w[b]);
      }
      for (int j = 0; j < 16; ++j) {
        __m512i even[GB], odd[GB];  // pairs 32 c + 2j and 32 c + 2j + 1 of each group's keys
        for (int b = 0; b < GB; ++b) {
          table.words(_mm512_shuffle_epi8(_mm512_castps_si512(w[b][j]), split), even[b], odd[b]);
        }
        const uint32_t* q = qw + 32 * c + 2 * j;
        for (int r = 0; r < R; ++r) {
          const __m512bh qe = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * (d / 2)]));
          for (int b = 0; b < GB; ++b) dot[r][b] = _mm512_dpbf16_ps(dot[r][b], qe, (__m512bh)even[b]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512bh qo = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * (d / 2) + 1]));
          for (int b = 0; b < GB; ++b) dot[r][b] = _mm512_dpbf16_ps(dot[r][b], qo, (__m512bh)odd[b]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < GB; ++b) sc[r][g0 + b] = static_cast<vf>(dot[r][b]) * scale;
    }
  }
}

// The values of two keys' code rows ``a`` (key 2j) and ``b`` (key 2j + 1) as bf16 pairs of
// keys, pair_values' words: per 64 dimensions, two byte permutes over both rows interleave
// them (a 128-bit lane's low 8 bytes a's and b's codes of 4 dimensions, its high 8 those of
// the 4 dimensions 16 on), and the table makes each 64 codes two vectors of pairs.
template <int NC>
inline void fp8_pair_values(const uint8_t* a, const uint8_t* b, const Fp8Bytes& table, __m512i (&v)[NC]) {
  static_assert(NC % 4 == 0, "64 codes a row part");
  // Byte 16 l + 2m (+ 1) of a part's first interleave: a's (b's) dimension 4 l + m; byte
  // 16 l + 8 + 2m (+ 1): dimension 16 + 4 l + m. The second takes the 32 dimensions after.
  alignas(64) static constexpr uint8_t kFirst[64] = {
      0,  64, 1,  65, 2,  66, 3,  67, 16, 80, 17, 81, 18, 82, 19, 83,   //
      4,  68, 5,  69, 6,  70, 7,  71, 20, 84, 21, 85, 22, 86, 23, 87,   //
      8,  72, 9,  73, 10, 74, 11, 75, 24, 88, 25, 89, 26, 90, 27, 91,   //
      12, 76, 13, 77, 14, 78, 15, 79, 28, 92, 29, 93, 30, 94, 31, 95};  //
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_add_epi8(first, _mm512_set1_epi8(32));
  for (int c = 0; c < NC; c += 4) {
    const __m512i x = _mm512_loadu_si512(a + c * kLanes), y = _mm512_loadu_si512(b + c * kLanes);
    table.words(_mm512_permutex2var_epi8(x, first, y), v[c], v[c + 1]);
    table.words(_mm512_permutex2var_epi8(x, second, y), v[c + 2], v[c + 3]);
  }
}

// narrow_block for R rows over the full, unmasked block of kBlock keys from ``start`` of
// ``src``'s pages, read in place (the other arguments as narrow_block's with ``Pairs``). While
// its keys are transposed, the thread's stream steps (Scratch::streaming), or else the code
// rows of the next ``next_n`` keys are prefetched, a key at a time (as attend_run's ``ahead``).
template <int NC, int R>
void fp8_narrow_block(const Fp8Narrow& src, int64_t start, int64_t next_n, const uint32_t* __restrict qw, float scale,
                      vf& vm, vf& vl, float* __restrict acc, Scratch& scratch) {
  const uint8_t* krow[kBlock];
  const uint8_t* vrow[kBlock];
  int64_t next[kBlock];
  src.codes.offsets(src.pages, src.h, start, kBlock, [&](int64_t t, int64_t off) {
    krow[t] = src.codes.k + off;
    vrow[t] = src.codes.v + off;
  });
  src.codes.offsets(src.pages, src.h, start + kBlock, next_n, [&](int64_t t, int64_t off) { next[t] = off; });
  auto ahead = [&](int64_t t) {
    if (scratch.streaming) scratch.stream.step();
    else if (t < next_n) prefetch_row(src.codes, next[t]);
  };
  vf sc[R][kBlock / kLanes];
  fp8_scores<NC, R>(krow, *src.table, qw, scale, sc, ahead);
  const vf alpha = narrow_softmax<R>(sc, vm, vl, scratch.ps.data());
  narrow_value_pairs<NC, R>(acc, alpha, scratch.ps.data(), scratch, [&](int64_t j, __m512i (&v)[NC]) {
    fp8_pair_values<NC>(vrow[2 * j], vrow[2 * j + 1], *src.table, v);
  });
}
#endif

}  // namespace radixserve_cpu::paged
