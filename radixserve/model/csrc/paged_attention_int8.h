// The paged-attention kernel over int8 pages for bf16 queries, in integer arithmetic: the
// scores and the probabilities' products with the values are sums of 16-bit products in
// 32-bit integers (vpdpwssd, AVX-512 VNNI), with the scales applied after.
//
// Why: decoding int8 codes to bf16 rows first (paged_attention_quant.h) costs a widening, a
// conversion, a multiply and a rounding per 16 values, on top of the same bf16 attention a
// bf16 page gets; it made a decode step over int8 pages slower than over bf16 pages, whose
// bytes it halves (benchmarks/long_context.md). Here a code is only widened to 16 bits: the
// keys transposed as bytes (half the shuffles of bf16 keys' words), the values paired as bf16
// values are.
//
// The arithmetic, per row r and key t of a block of kBlock keys:
// - the query as 16-bit integers: q'' = rne(q * qs_r), qs_r = 32767 / max |q_r|; the score
//   (float(sum_d q''_d c_td) * ks_t) * (scale / qs_r), the sum exact (|q''| <= 2^15, |c| <=
//   2^7, d <= 256);
// - the probabilities p_rt = exp2(s_rt - m_r) as every path takes them (the block's sum in
//   its one order, paged_attention.h), then p'_rt = p_rt * vs_t as 16-bit integers against
//   the row's largest, p''_rt = rne(p'_rt * 32767 / M_r); acc_r = acc_r * alpha_r +
//   float(sum_t p''_rt c_t) * (M_r / 32767), the sum exact again.
// Rounding q to 16 bits against its largest element errs by at most 1/65534 of that element,
// less than rounding it to bf16 did (1/512 of it); the probabilities likewise, against
// bf16's 1/512 of each. The keys and values are not rounded at all (the bf16 path rounded
// code * scale to bf16). So the outputs come closer to exact attention over the stored codes
// than the decoded path's (tests/model/test_native_int8_attention.py).
//
// Every bf16 row over int8 pages takes this path: a decode token's few query heads with the
// keys in the lanes, read from the pages (int8_block), a prefill's rows in the lanes over a
// block made ready for them (int8_rows_block). A row's arithmetic is its own and the same on
// both: its bits do not depend on which rows share its block, so a decode row and the prefill
// row of the same position agree bit for bit, as speculative decoding's verify rows need.
// The integer sums are exact, so the dimensions and keys may be taken in any order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "paged_attention.h"
#include "paged_attention_narrow.h"
#include "paged_attention_quant.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && RADIXSERVE_VEC_BF16
#define RADIXSERVE_INT8_DOTS 1
#include <immintrin.h>
#else
#define RADIXSERVE_INT8_DOTS 0
#endif

namespace radixserve_cpu::paged {

// Whether rows of queries ``Q`` over ``qp``'s pages of head size ``d`` take this path: int8
// codes, bf16 queries (float queries keep their float arithmetic, which 16-bit queries would
// coarsen), head sizes of whole 64-byte rows (64, 128, 256).
template <typename Q>
inline bool int8_dots_for(const QuantPages* qp, int64_t d) {
  return RADIXSERVE_INT8_DOTS && std::is_same_v<Q, c10::BFloat16> && qp != nullptr && qp->codes == Codes::kInt8 &&
         (d == 64 || d == 128 || d == 256);
}

#if RADIXSERVE_INT8_DOTS
constexpr int32_t kInt16Max = 32767;

// A block of kBlock keys as the products read them: the rows of their codes in the pages
// (``k``, ``v``; a row of zeros past the block's end) and their scales (``ks``, ``vs``; zero
// past the end); for a block taken by more than kInt8Rows rows, also made ready once for all
// of them in the thread's scratch (prepare_int8_block): ``kt`` [d / 2][kBlock] words, word
// (p, t) two 16-bit codes of key t (pair p's dimensions, in the pairs' order below), and ``tv``
// [kBlock / 2][d] words, word (j, i) dimension i of keys 2j (low half) and 2j + 1.
struct Int8Block {
  const int8_t* k[kBlock];
  const int8_t* v[kBlock];
  float* ks;
  float* vs;
  int32_t* kt;
  int32_t* tv;
  explicit Int8Block(Scratch& sc)
      : ks(sc.int8_scales.data()),
        vs(sc.int8_scales.data() + kBlock),
        kt(sc.int8_keys.data()),
        tv(sc.int8_values.data()) {}
  // A block made ready elsewhere (Int8Runs): ``words`` holds kt, tv, ks and vs in turn.
  Int8Block(int32_t* words, int64_t d)
      : ks(reinterpret_cast<float*>(words + d * kBlock)),
        vs(reinterpret_cast<float*>(words + d * kBlock) + kBlock),
        kt(words),
        tv(words + d / 2 * kBlock) {}
  // Its words, in 32-bit words: kt and tv (d / 2 x kBlock each), ks and vs.
  static constexpr int64_t words(int64_t d) { return d * kBlock + 2 * kBlock; }
};

// A work item's rows up to this many (a decode token's query heads of one KV head: 3 for
// SmolLM2) read a block's codes from the pages as they go, keys in the lanes; more (a
// prefill's 16) take the block made ready (prepare_int8_block), rows in the lanes. (As the
// narrow blocks': with_narrow_rows makes the count a constant.)
constexpr int64_t kInt8Rows = kNarrowRows;

// acc + the products of a's and b's 16-bit words, by pairs (vpdpwssd), the accumulator tied to
// its register: with the intrinsic, GCC 12 copied every accumulator of these loops to another
// register and back at each step (a move per product).
__attribute__((always_inline)) inline __m512i dot_words(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}

// dot_words with b the word at ``p``, broadcast to every lane by the instruction itself.
__attribute__((always_inline)) inline __m512i dot_words_bcast(__m512i acc, __m512i a, const uint32_t* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*p));
  return acc;
}

// acc[u] + the products of a's words and word u at ``k`` (broadcast to every lane by the
// instruction itself, from memory), u < 8: one statement, the eight accumulators tied to
// their registers. (With the intrinsic GCC 12 broadcast each word in an instruction of its
// own and copied each accumulator to another register at each step; one instruction per
// product with a single asm statement each, it kept the accumulators in memory.)
__attribute__((always_inline)) inline void dot8_bcast(__m512i (&acc)[8], __m512i a, const int32_t* k) {
  asm("vpdpwssd (%[k])%{1to16%}, %[a], %[x0]\n\t"
      "vpdpwssd 4(%[k])%{1to16%}, %[a], %[x1]\n\t"
      "vpdpwssd 8(%[k])%{1to16%}, %[a], %[x2]\n\t"
      "vpdpwssd 12(%[k])%{1to16%}, %[a], %[x3]\n\t"
      "vpdpwssd 16(%[k])%{1to16%}, %[a], %[x4]\n\t"
      "vpdpwssd 20(%[k])%{1to16%}, %[a], %[x5]\n\t"
      "vpdpwssd 24(%[k])%{1to16%}, %[a], %[x6]\n\t"
      "vpdpwssd 28(%[k])%{1to16%}, %[a], %[x7]"
      : [x0] "+v"(acc[0]), [x1] "+v"(acc[1]), [x2] "+v"(acc[2]), [x3] "+v"(acc[3]), [x4] "+v"(acc[4]),
        [x5] "+v"(acc[5]), [x6] "+v"(acc[6]), [x7] "+v"(acc[7])
      : [a] "v"(a), [k] "r"(k), "m"(*reinterpret_cast<const int32_t(*)[8]>(k)));
}

// The pairs' order: the words of a key (and of a query) hold two of its dimensions each, pair
// p of a 64-dimension part (p < 32, j = p / 2) dimensions 4j and 4j + 2 for an even p, 4j + 1
// and 4j + 3 for an odd one. (The keys are transposed 4 bytes at a time, and each 16-bit half
// of those 4 bytes becomes one 16-bit code by arithmetic shifts: int8_key_words.)

// Row ``q`` (d floats holding bf16 values) as 16-bit integers in the keys' pairs (``words``,
// d / 2 of them); returns the factor its integer scores take: scale / qs, 0 for a row of zeros.
// Vector code (a prefill chunk converts each of its rows once per chunk of keys): per 32
// dimensions, two products rounded to nearest even (no code passes 32767: q * qs is at most
// 32767 by a few ulps, and the conversion saturates), narrowed to 16 bits, and the middle two
// of every four swapped (the pairs' order).
template <int NC>
inline float int8_query(const float* q, float scale, int32_t* words) {
  __m512 top = _mm512_setzero_ps();
  for (int c = 0; c < NC; ++c) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(q + c * kLanes)));
  const float most = _mm512_reduce_max_ps(top);  // a maximum: any order
  if (most == 0.0f) {
    std::fill(words, words + NC * kLanes / 2, 0);
    return 0.0f;
  }
  const float qs = static_cast<float>(kInt16Max) / most;
  alignas(64) static constexpr uint16_t kSwap[32] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,  11, 12, 14, 13, 15,
                                                     16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};
  const __m512i swap = _mm512_load_si512(kSwap);
  const __m512 by = _mm512_set1_ps(qs);
  for (int c = 0; c < NC; c += 2) {
    const __m256i a = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + c * kLanes), by)));
    const __m256i b =
        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + (c + 1) * kLanes), by)));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    _mm512_storeu_si512(words + c * kLanes / 2, _mm512_permutexvar_epi16(swap, both));
  }
  return scale / qs;
}

// Keys [start, start + n) of ``pages`` (n <= kBlock), KV head ``h``, of int8 pages: their rows
// and scales into ``b``. ``ahead(t)``: called once per key (to prefetch what comes next).
template <int NC, typename G, typename Ahead>
void gather_int8_block(const Layer<G>& geo, const QuantPages& qp, int64_t h, const int64_t* pages, int64_t start,
                       int64_t n, Int8Block& b, Ahead&& ahead) {
  constexpr int64_t d = NC * kLanes;
  alignas(64) static constexpr int8_t kZeros[d] = {};
  constexpr int shift = __builtin_ctzll(static_cast<unsigned long long>(d));  // a slot's scale: offset / d
  const auto* k = reinterpret_cast<const int8_t*>(qp.k);
  const auto* v = reinterpret_cast<const int8_t*>(qp.v);
  geo.offsets(pages, h, start, n, [&](int64_t t, int64_t off) {
    b.k[t] = k + off, b.v[t] = v + off;
    b.ks[t] = qp.k_scale[off >> shift], b.vs[t] = qp.v_scale[off >> shift];
    ahead(t);
  });
  for (int64_t t = n; t < kBlock; ++t) b.k[t] = b.v[t] = kZeros, b.ks[t] = b.vs[t] = 0.0f;
}

// Keys 16 g .. 16 g + 15 of ``b``, 64 dimensions from 64 c on, as 16-bit codes: one 16 x 16
// transposition of 32-bit words (transpose16: lane i of w[j] holds bytes 4j .. 4j + 3 of key
// i), then each word's two 16-bit halves arithmetic-shifted: bytes 0 and 2 (pair 2j of the
// part), bytes 1 and 3 (pair 2j + 1). ``use(p, words)``: pair p of the part (0 .. 31).
template <typename Use>
__attribute__((always_inline)) inline void int8_key_words(const Int8Block& b, int64_t g, int64_t c, Use&& use) {
  const float* rows[16];
  for (int i = 0; i < 16; ++i) rows[i] = reinterpret_cast<const float*>(b.k[g * kLanes + i]);
  __m512 w[16];
  transpose16(rows, c * kLanes, w);
  for (int j = 0; j < 16; ++j) {
    const __m512i x = _mm512_castps_si512(w[j]);
    use(2 * j, _mm512_srai_epi16(_mm512_slli_epi16(x, 8), 8));
    use(2 * j + 1, _mm512_srai_epi16(x, 8));
  }
}

// The values of keys 2j and 2j + 1 of ``b``, 32 dimensions from ``c`` on, widened to 16 bits
// and interleaved: word i of out[0] holds dimension c + i of key 2j (low half) and of key
// 2j + 1, out[1] dimensions c + 16 ...
__attribute__((always_inline)) inline void int8_value_words(const Int8Block& b, int64_t j, int64_t c,
                                                            __m512i (&out)[2]) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.v[2 * j] + c)));
  const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.v[2 * j + 1] + c)));
  out[0] = _mm512_permutex2var_epi16(x, lo, y);
  out[1] = _mm512_permutex2var_epi16(x, hi, y);
}

// The block's words made ready in ``b.kt`` and ``b.tv`` (Int8Block), for many rows to read.
template <int NC>
void prepare_int8_block(Int8Block& b) {
  constexpr int64_t d = NC * kLanes;
  for (int64_t g = 0; g < kBlock / kLanes; ++g) {
    for (int64_t c = 0; c < d / 64; ++c) {
      int8_key_words(b, g, c, [&](int64_t p, __m512i words) {
        _mm512_storeu_si512(b.kt + (c * 32 + p) * kBlock + g * kLanes, words);
      });
    }
  }
  for (int64_t j = 0; j < kBlock / 2; ++j) {
    for (int64_t c = 0; c < d; c += 32) {
      __m512i v[2];
      int8_value_words(b, j, c, v);
      _mm512_storeu_si512(b.tv + j * d + c, v[0]);
      _mm512_storeu_si512(b.tv + j * d + c + kLanes, v[1]);
    }
  }
}

// The integer scores of R rows (``qw``: R x d / 2 words) against the block's keys, read from
// the pages' rows and transposed as they are used: dot[r][g] lane i, row r's sum for key
// 16 g + i.
template <int NC, int R>
inline void int8_scores(const Int8Block& b, const int32_t* qw, __m512i (&dot)[R][kBlock / kLanes]) {
  constexpr int64_t d = NC * kLanes, G = kBlock / kLanes;
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < d / 64; ++c) {
      int8_key_words(b, g, c, [&](int64_t p, __m512i words) {
        for (int r = 0; r < R; ++r) acc[r] = dot_words(acc[r], _mm512_set1_epi32(qw[r * (d / 2) + c * 32 + p]), words);
      });
    }
    for (int r = 0; r < R; ++r) dot[r][g] = acc[r];
  }
}

// Rows [r0, r0 + RB)'s probabilities as pairs of 16-bit integers (*pair(r, j): keys 2j and
// 2j + 1 of row r) times the block's values, into ``x`` (NC vectors of dimensions a row),
// summed exactly, over the first ``pairs`` pairs of keys (those after hold probability zero).
// ``Ready``: the values made ready, else read from the pages' rows.
template <int NC, int RB, bool Ready, typename Pair>
inline void int8_products(const Int8Block& b, Pair&& pair, int64_t r0, int64_t pairs, __m512i (&x)[RB][NC]) {
  constexpr int64_t d = NC * kLanes;
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < NC; ++c) x[i][c] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i v[NC];
    if constexpr (Ready) {
      for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_si512(b.tv + j * d + c * kLanes);
    } else {
      for (int c = 0; c < NC; c += 2) {
        __m512i two[2];
        int8_value_words(b, j, c * kLanes, two);
        v[c] = two[0], v[c + 1] = two[1];
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) x[i][c] = dot_words_bcast(x[i][c], v[c], pair(r0 + i, j));
    }
  }
}

// acc rows [r0, r0 + RB) = acc * alpha + the products of their probabilities' pairs and the
// block's values, times ``gain`` (row r's in alpha[r], gain[r]).
template <int NC, int RB, bool Ready, typename Pair>
inline void int8_accumulate_rows(const Int8Block& b, Pair&& pair, int64_t r0, int64_t pairs, const float* alpha,
                                 const float* gain, float* acc) {
  constexpr int64_t d = NC * kLanes;
  __m512i x[RB][NC];
  int8_products<NC, RB, Ready>(b, pair, r0, pairs, x);
  for (int i = 0; i < RB; ++i) {
    float* a = acc + (r0 + i) * d;
    for (int c = 0; c < NC; ++c) {
      const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(a + c * kLanes), _mm512_set1_ps(alpha[r0 + i]));
      const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x[i][c]), _mm512_set1_ps(gain[r0 + i]), scaled);
      _mm512_storeu_ps(a + c * kLanes, y);
    }
  }
}

// int8_accumulate_rows for rows [0, rows): as many rows at a time as 16 accumulators hold
// (16 / NC), then fewer; a row's arithmetic is the same either way.
template <int NC, bool Ready, typename Pair>
inline void int8_accumulate(const Int8Block& b, Pair&& pair, int64_t rows, int64_t pairs, const float* alpha,
                            const float* gain, float* acc) {
  int64_t r = 0;
  if constexpr (NC <= 4) {
    for (; r + 4 <= rows; r += 4) int8_accumulate_rows<NC, 4, Ready>(b, pair, r, pairs, alpha, gain, acc);
  }
  if constexpr (NC <= 8) {
    for (; r + 2 <= rows; r += 2) int8_accumulate_rows<NC, 2, Ready>(b, pair, r, pairs, alpha, gain, acc);
  }
  for (; r < rows; ++r) int8_accumulate_rows<NC, 1, Ready>(b, pair, r, pairs, alpha, gain, acc);
}

// The keys of a block [start, start + n) that row ``r`` sees: from its first (a window's;
// ``first`` null: from 0) to ``last``, the block's last up to the row's limit (causal;
// ``limit`` null: none). None where last < from.
struct RowKeys {
  int64_t from, last;
  RowKeys(int64_t start, int64_t n, const int32_t* limit, const int32_t* first, int64_t r)
      : from(first != nullptr ? first[r] : 0),
        last(std::min<int64_t>(start + n - 1, limit != nullptr ? limit[r] : INT32_MAX)) {}
};

// R <= kInt8Rows rows (their words ``qw``, R x d / 2, and factors ``f``, int8_query) over keys
// [start, start + n) of ``b`` with the keys in the lanes (a decode token's few query heads),
// read from the pages' rows: updating their softmax state ``m``, ``l``, ``acc`` (rows r at
// m[r], l[r], acc + r d). ``limit``, ``first``: per row, the last key and the first it may
// see (or null); ``cap2``: the soft-cap (0: none). ``pr``: R x kBlock 16-bit words.
// Every float operation of a row's is int8_rows_block's, on the same values, in the same
// order (the integer sums are exact, whatever their order), so a row gets the same bits either
// way: a decode row here, the prefill row of its position there.
template <int NC, int R>
void int8_block(const Int8Block& b, int64_t start, int64_t n, const int32_t* qw, const float* f,
                const int32_t* limit, const int32_t* first, float cap2, float* m, float* l, float* acc,
                uint16_t* __restrict pr) {
  constexpr int64_t G = kBlock / kLanes;
  __m512i dot[R][G];
  int8_scores<NC, R>(b, qw, dot);
  vf ks[G], vs[G];
  for (int g = 0; g < G; ++g) ks[g] = load_vf(b.ks + g * kLanes), vs[g] = load_vf(b.vs + g * kLanes);
  const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  float alpha[R], gain[R];
  for (int r = 0; r < R; ++r) {
    const RowKeys sees(start, n, limit, first, r);
    vf s[G];
    vi seen[G];
    vf high = splat(kNoMax);
    for (int g = 0; g < G; ++g) {
      const vi key = iota + static_cast<int32_t>(start + g * kLanes);
      seen[g] = (key <= static_cast<int32_t>(sees.last)) & (key >= static_cast<int32_t>(sees.from));
      s[g] = (static_cast<vf>(_mm512_cvtepi32_ps(dot[r][g])) * ks[g]) * f[r];
      if (cap2 != 0.0f) s[g] = soft_cap(s[g], cap2);
      high = vmax(high, seen[g] ? s[g] : splat(kNoMax));
    }
    const float top = std::max(m[r], _mm512_reduce_max_ps(static_cast<__m512>(high)));  // any order
    const vf mx = splat(top);
    alpha[r] = exp2_nonpositive(splat(m[r]) - mx)[0];
    vf part{}, peak{};
    for (int g = 0; g < G; ++g) {
      const vf e = seen[g] ? exp2_nonpositive(s[g] - mx) : vf{};
      part = g == 0 ? e : part + e;  // the block sum's order (paged_attention.h)
      s[g] = e * vs[g];              // the probabilities times the values' scales
      peak = vmax(peak, s[g]);
    }
    m[r] = top;
    l[r] = l[r] * alpha[r] + lane_sum(part);
    // As 16-bit integers against the row's largest, and the factor that undoes it. (A block
    // whose largest is below 2^-100 of the row's maximum, 1, adds nothing: its factor would
    // overflow a float.)
    const float most = _mm512_reduce_max_ps(static_cast<__m512>(peak));
    const vf to_int = splat(most > 0x1p-100f ? static_cast<float>(kInt16Max) / most : 0.0f);
    gain[r] = most / static_cast<float>(kInt16Max);
    for (int g = 0; g < G; ++g) {
      const __m512i x = _mm512_cvtps_epi32(static_cast<__m512>(s[g] * to_int));  // to nearest even
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + r * kBlock + g * kLanes), _mm512_cvtepi32_epi16(x));
    }
  }
  auto pair = [&](int64_t r, int64_t j) { return reinterpret_cast<const uint32_t*>(pr + r * kBlock + 2 * j); };
  int8_accumulate<NC, false>(b, pair, R, (n + 1) / 2, alpha, gain, acc);
}

// ``rows`` (<= 16) rows in the lanes over keys [start, start + n) of ``b``, made ready
// (prepare_int8_block): a prefill's or an extend's block of rows. ``qt``: the rows' words
// transposed (qt[p] lane r: row r's pair p; zero past ``rows``), ``f``: their factors
// (lane r); the rest as int8_block's (``pw``: kBlock / 2 x 16 words). Each key's score is
// one integer sum per row, its pairs broadcast from the block; every float operation of a
// row's is int8_block's (its block sum in the lanes_sum order that matches lane_sum).
template <int NC>
void int8_rows_block(const Int8Block& b, int64_t start, int64_t n, int64_t rows, const __m512i* qt, vf f,
                     const int32_t* limit, const int32_t* first, float cap2, float* m, float* l, float* acc,
                     uint32_t* __restrict pw) {
  constexpr int64_t d = NC * kLanes;
  int32_t lim[kLanes], fst[kLanes];
  float mv[kLanes], lv[kLanes];
  for (int64_t r = 0; r < kLanes; ++r) {
    const RowKeys sees = r < rows ? RowKeys(start, n, limit, first, r) : RowKeys(start, 0, nullptr, nullptr, r);
    lim[r] = static_cast<int32_t>(sees.last), fst[r] = static_cast<int32_t>(sees.from);  // past the rows: none
    mv[r] = r < rows ? m[r] : kNoMax;
    lv[r] = r < rows ? l[r] : 0.0f;
  }
  vi vlim, vfst;
  std::memcpy(&vlim, lim, sizeof vlim);
  std::memcpy(&vfst, fst, sizeof vfst);
  vf s[kBlock];
  vf high = splat(kNoMax);
  const int64_t scored = (n + 7) / 8 * 8;  // keys past the block's end: seen by no row
  for (int64_t t = scored; t < kBlock; ++t) s[t] = splat(kNoMax);
  for (int64_t t0 = 0; t0 < scored; t0 += 8) {  // eight keys' sums side by side
    // (Unrolled, so that the accumulators stay in registers: indexed in a loop, GCC kept the
    // array in memory and stored all eight after every step.)
    __m512i dot[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) dot[u] = _mm512_setzero_si512();
    for (int64_t p = 0; p < d / 2; ++p) dot8_bcast(dot, qt[p], b.kt + p * kBlock + t0);
    vf x[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) x[u] = (static_cast<vf>(_mm512_cvtepi32_ps(dot[u])) * b.ks[t0 + u]) * f;
    for (int u = 0; u < 8; ++u) {
      const int64_t t = t0 + u;
      const vi key = vi{} + static_cast<int32_t>(start + t);
      if (cap2 != 0.0f) x[u] = soft_cap(x[u], cap2);
      const vi seen = (key <= vlim) & (key >= vfst);
      s[t] = seen ? x[u] : splat(kNoMax);
      high = vmax(high, s[t]);
    }
  }
  const vf vm = load_vf(mv);
  const vf top = vmax(vm, high);
  const vf alpha = exp2_nonpositive(vm - top);
  vf peak{};
  for (int64_t t = 0; t < kBlock; ++t) {
    const vi key = vi{} + static_cast<int32_t>(start + t);
    const vi seen = (key <= vlim) & (key >= vfst);
    s[t] = seen ? exp2_nonpositive(s[t] - top) : vf{};
  }
  const vf lsum = load_vf(lv) * alpha + block_sum(s);
  for (int64_t t = 0; t < kBlock; ++t) {
    s[t] = s[t] * b.vs[t];  // the probabilities times the values' scales
    peak = vmax(peak, s[t]);
  }
  const vf to_int = peak > splat(0x1p-100f) ? splat(static_cast<float>(kInt16Max)) / peak : vf{};
  const vf gain = peak / static_cast<float>(kInt16Max);
  for (int64_t j = 0; j < kBlock / 2; ++j) {  // pw[j * 16 + r]: row r's keys 2j (low half), 2j + 1
    const __m512i lo = _mm512_cvtps_epi32(static_cast<__m512>(s[2 * j] * to_int));  // to nearest even
    const __m512i hi = _mm512_cvtps_epi32(static_cast<__m512>(s[2 * j + 1] * to_int));
    const __m512i w = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16));
    _mm512_storeu_si512(pw + j * kLanes, w);
  }
  float av[kLanes], gv[kLanes];
  store_vf(av, alpha);
  store_vf(gv, gain);
  for (int64_t r = 0; r < rows; ++r) m[r] = top[r], l[r] = lsum[r];
  auto pair = [&](int64_t r, int64_t j) { return pw + j * kLanes + r; };
  int8_accumulate<NC, true>(b, pair, rows, (n + 1) / 2, av, gv, acc);
}

// int8 runs made ready whole (Int8Block's words for each block of kBlock keys), once per
// kernel call, for the many rows of a prefill or an extend (RunBuffer), as WholeRuns decodes
// runs whole for the decoding path: made ready for each block of kRowBlock rows, every block
// of a 2,048-row chunk's 384 per KV head would make the same keys ready again. The words are
// prepare_int8_block's own, so the outputs are the same bits.
class Int8Runs : public RunBuffer<int32_t, Int8Runs> {
 public:
  using RunBuffer::RunBuffer;

  // Take ``run`` to be made ready whole: its index, or -1 (its blocks are made ready as read).
  int64_t add(KeyRun run) { return take(run, kv_heads_ * blocks(run.len) * Int8Block::words(d_)); }

  // Thread ``t`` of a team of ``nt``: its share of the tasks (RunBuffer::share), each block
  // gathered from ``qp``'s pages and made ready in place.
  template <typename G>
  void ready_share(const Layer<G>& geo, const QuantPages& qp, int64_t t, int64_t nt) const {
    switch (d_) {
      case 64: return ready_share<4>(geo, qp, t, nt);
      case 128: return ready_share<8>(geo, qp, t, nt);
      default: return ready_share<16>(geo, qp, t, nt);
    }
  }

  // Block ``blk`` (keys kBlock blk ..) of run ``i``, KV head ``h`` (a run's words:
  // [kv_heads, blocks, Int8Block::words]).
  Int8Block block(int64_t i, int64_t h, int64_t blk) const {
    return {words(i) + (h * blocks(run(i).len) + blk) * Int8Block::words(d_), d_};
  }

 private:
  template <int NC, typename G>
  void ready_share(const Layer<G>& geo, const QuantPages& qp, int64_t t, int64_t nt) const {
    share(t, nt, [&](const ChunkTask& task) {
      const KeyRun r = run(task.run);
      for (int64_t lo = task.lo; lo < std::min(r.len, task.lo + kChunk); lo += kBlock) {
        Int8Block b = block(task.run, task.head, lo / kBlock);
        gather_int8_block<NC>(geo, qp, task.head, r.pages, lo, std::min(kBlock, r.len - lo), b, [](int64_t) {});
        prepare_int8_block<NC>(b);
      }
    });
  }

  static int64_t blocks(int64_t len) { return (len + kBlock - 1) / kBlock; }
};

// ``rows`` rows (``q``: [rows, d], unscaled bf16 values; ``scale``: their scores' factor) over
// keys [key_begin, key_end) of ``run`` (key_begin a multiple of kChunk) on int8 pages, KV
// head ``h``, updating the rows' softmax state; the arguments as attend_run's. Each block of
// keys is gathered once for all the rows; up to kInt8Rows rows read it in place, keys in the
// lanes (int8_block), more take it made ready, rows in the lanes (int8_rows_block): the run
// made ready whole where ``whole`` holds it (``whole_run`` >= 0), else block by block here.
template <int NC, typename G>
void int8_attend(const Layer<G>& geo, const QuantPages& qp, int64_t h, KeyRun run, const Int8Runs* whole,
                 int64_t whole_run, int64_t key_begin, int64_t key_end, const float* q, float scale, int64_t rows,
                 const int32_t* limit, const int32_t* first, float cap2, float* m, float* l, float* acc,
                 Scratch& sc) {
  constexpr int64_t d = NC * kLanes;
  int32_t* qw = sc.int8_queries.data();
  alignas(64) float f[kRowBlock] = {};
  for (int64_t r = 0; r < rows; ++r) f[r] = int8_query<NC>(q + r * d, scale, qw + r * (d / 2));
  const bool ready = rows > kInt8Rows;
  __m512i qt[d / 2];
  if (ready) {  // the rows' words transposed, rows in the lanes
    alignas(64) int32_t words[kLanes][d / 2] = {};
    const float* src[kLanes];
    for (int64_t r = 0; r < kLanes; ++r) {
      if (r < rows) std::memcpy(words[r], qw + r * (d / 2), sizeof words[r]);
      src[r] = reinterpret_cast<const float*>(words[r]);
    }
    for (int64_t c = 0; c < d / 2; c += kLanes) {
      __m512 t[16];
      transpose16(src, c, t);
      for (int64_t j = 0; j < kLanes; ++j) qt[c + j] = _mm512_castps_si512(t[j]);
    }
  }
  int64_t lo = key_begin, hi = key_end;
  if (limit != nullptr) hi = std::min<int64_t>(hi, *std::max_element(limit, limit + rows) + 1);
  if (first != nullptr) lo = std::max<int64_t>(lo, *std::min_element(first, first + rows));
  Int8Block b(sc);
  for (int64_t start = lo - lo % kBlock; start < hi; start += kBlock) {
    const int64_t n = std::min(kBlock, hi - start);
    if (ready && whole != nullptr && whole_run >= 0) {
      const Int8Block w = whole->block(whole_run, h, start / kBlock);
      int8_rows_block<NC>(w, start, n, rows, qt, load_vf(f), limit, first, cap2, m, l, acc, sc.int8_probs.data());
      continue;
    }
    // The next block's rows, unless the thread streams its next chunk (then a step per key).
    const int64_t next = sc.streaming ? 0 : std::min(kBlock, hi - start - n);
    int64_t ahead_off[kBlock];
    geo.offsets(run.pages, h, start + n, next, [&](int64_t t, int64_t off) { ahead_off[t] = off; });
    gather_int8_block<NC>(geo, qp, h, run.pages, start, n, b, [&](int64_t t) {
      if (sc.streaming) {
        sc.stream.step();
      } else if (t < next) {
        for (int64_t line = 0; line < d; line += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(qp.k) + ahead_off[t] + line, 0, 1);
          __builtin_prefetch(reinterpret_cast<const char*>(qp.v) + ahead_off[t] + line, 0, 1);
        }
      }
    });
    // Rows that see none of the block would keep their state as it is (acc * 1 + 0): skipped.
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      const RowKeys sees(start, n, limit, first, r);
      any |= sees.last >= std::max(start, sees.from);
    }
    if (!any) continue;
    if (ready) {
      prepare_int8_block<NC>(b);
      int8_rows_block<NC>(b, start, n, rows, qt, load_vf(f), limit, first, cap2, m, l, acc, sc.int8_probs.data());
      continue;
    }
    uint16_t* pr = reinterpret_cast<uint16_t*>(sc.int8_probs.data());
    with_narrow_rows(rows, [&](auto rows_c) {
      int8_block<NC, decltype(rows_c)::value>(b, start, n, qw, f, limit, first, cap2, m, l, acc, pr);
    });
  }
}
#else
// (No integer path in this build: no run is ever taken.)
class Int8Runs {
 public:
  Int8Runs(int64_t, int64_t) {}
  int64_t add(KeyRun) { return -1; }
  bool empty() const { return true; }
  void prepare() {}
  template <typename G>
  void ready_share(const Layer<G>&, const QuantPages&, int64_t, int64_t) const {}
};
#endif

// int8_attend for head size ``d`` where rows of queries ``Q`` over ``qp``'s pages take it
// (int8_dots_for), else null.
template <typename G>
using Int8AttendFn = void (*)(const Layer<G>&, const QuantPages&, int64_t, KeyRun, const Int8Runs*, int64_t, int64_t,
                              int64_t, const float*, float, int64_t, const int32_t*, const int32_t*, float, float*,
                              float*, float*, Scratch&);

template <typename Q, typename G>
Int8AttendFn<G> int8_attend_fn(const QuantPages* qp, int64_t d) {
  if (!int8_dots_for<Q>(qp, d)) return nullptr;
#if RADIXSERVE_INT8_DOTS
  switch (d) {
    case 64: return int8_attend<4, G>;
    case 128: return int8_attend<8, G>;
    case 256: return int8_attend<16, G>;
  }
#endif
  return nullptr;
}

}  // namespace radixserve_cpu::paged
