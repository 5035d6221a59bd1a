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
// Every bf16 row over int8 pages takes this path (decode rows and prefill rows alike, a block of
// up to four rows at a time), and a row's arithmetic is its own: its bits do not depend on
// which rows share its block, so a decode row and the prefill row of the same position agree
// bit for bit, as speculative decoding's verify rows need. The integer sums are exact, so
// the dimensions and keys may be taken in any order.
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
// (p, t) two 16-bit codes of key t (pair p's dimensions, int8_pair_dims), and ``tv``
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
};

// Rows a block is taken by at a time; a work item's rows up to this many read the codes from
// the pages as they go (a decode token's query heads of one KV head: 3 for SmolLM2), more
// read the block made ready (prepare_int8_block) once for all of them (a prefill's 16 rows).
constexpr int64_t kInt8Rows = 4;

// The two dimensions of pair ``p`` of a key's (and a query's) words: a 64-dimension part c =
// p / 32, j = p % 32 / 2; the even pair holds dimensions 4j and 4j + 2 of it, the odd one 4j +
// 1 and 4j + 3. (The keys are transposed 4 bytes at a time, and each 16-bit half of those 4
// bytes becomes one 16-bit code by arithmetic shifts: int8_key_words.)
inline void int8_pair_dims(int64_t p, int64_t& lo, int64_t& hi) {
  const int64_t base = p / 32 * 64 + p % 32 / 2 * 4 + p % 2;
  lo = base, hi = base + 2;
}

// Row ``q`` (d floats holding bf16 values) as 16-bit integers in the keys' pairs (``words``,
// d / 2 of them); returns the factor its integer scores take: scale / qs, 0 for a row of zeros.
inline float int8_query(const float* q, int64_t d, float scale, int32_t* words) {
  float top = 0.0f;
  for (int64_t j = 0; j < d; ++j) top = std::max(top, std::fabs(q[j]));
  if (top == 0.0f) {
    std::fill(words, words + d / 2, 0);
    return 0.0f;
  }
  const float qs = static_cast<float>(kInt16Max) / top;
  auto code = [&](int64_t j) {
    const int32_t x = static_cast<int32_t>(std::nearbyint(q[j] * qs));  // to nearest even
    return static_cast<uint32_t>(static_cast<uint16_t>(std::clamp(x, -kInt16Max, kInt16Max)));
  };
  for (int64_t p = 0; p < d / 2; ++p) {
    int64_t lo, hi;
    int8_pair_dims(p, lo, hi);
    words[p] = static_cast<int32_t>(code(lo) | code(hi) << 16);
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

// The integer scores of R rows (``qw``: R x d / 2 words) against the block's keys: dot[r][g]
// lane i, row r's sum for key 16 g + i. ``Ready``: from the words made ready (each group's
// words loaded once for the rows), else from the pages' rows (transposed as they are used).
template <int NC, int R, bool Ready>
inline void int8_scores(const Int8Block& b, const int32_t* qw, __m512i (&dot)[R][kBlock / kLanes]) {
  constexpr int64_t d = NC * kLanes, G = kBlock / kLanes;
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) dot[r][g] = _mm512_setzero_si512();
  }
  if constexpr (Ready) {
    for (int64_t p = 0; p < d / 2; ++p) {
      __m512i k[G];
      for (int g = 0; g < G; ++g) k[g] = _mm512_loadu_si512(b.kt + p * kBlock + g * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512i w = _mm512_set1_epi32(qw[r * (d / 2) + p]);
        for (int g = 0; g < G; ++g) dot[r][g] = _mm512_dpwssd_epi32(dot[r][g], w, k[g]);
      }
    }
  } else {
    for (int64_t g = 0; g < G; ++g) {
      __m512i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
      for (int64_t c = 0; c < d / 64; ++c) {
        int8_key_words(b, g, c, [&](int64_t p, __m512i words) {
          for (int r = 0; r < R; ++r) {
            acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_set1_epi32(qw[r * (d / 2) + c * 32 + p]), words);
          }
        });
      }
      for (int r = 0; r < R; ++r) dot[r][g] = acc[r];
    }
  }
}

// Rows' probabilities (``pr``: R x kBlock 16-bit integers) times the block's values, into
// ``x`` (rows [r0, r0 + RB) of them, NC vectors of dimensions each), summed exactly.
template <int NC, int RB, bool Ready>
inline void int8_products(const Int8Block& b, const uint16_t* pr, int r0, int rb, __m512i (&x)[RB][NC]) {
  constexpr int64_t d = NC * kLanes;
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < NC; ++c) x[i][c] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < kBlock / 2; ++j) {
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
    for (int i = 0; i < rb; ++i) {
      int32_t pair;
      std::memcpy(&pair, pr + (r0 + i) * kBlock + 2 * j, sizeof pair);
      const __m512i w = _mm512_set1_epi32(pair);
      for (int c = 0; c < NC; ++c) x[i][c] = _mm512_dpwssd_epi32(x[i][c], w, v[c]);
    }
  }
}

// R <= kInt8Rows rows (their words ``qw``, R x d / 2, and factors ``f``, int8_query) over keys
// [start, start + n) of ``b``, updating their softmax state ``m``, ``l``, ``acc`` (rows r at
// m[r], l[r], acc + r d). ``limit``, ``first``: per row, the last key and the first it may
// see (or null); ``cap2``: the soft-cap (0: none). ``pr``: R x kBlock 16-bit words. A row's
// arithmetic is the same whichever rows share the block and whether its words were made
// ready (the integer sums are exact), so its bits are too.
template <int NC, int R, bool Ready>
void int8_block(const Int8Block& b, int64_t start, int64_t n, const int32_t* qw, const float* f,
                const int32_t* limit, const int32_t* first, float cap2, float* m, float* l, float* acc,
                uint16_t* __restrict pr) {
  constexpr int64_t d = NC * kLanes, G = kBlock / kLanes;
  __m512i dot[R][G];
  int8_scores<NC, R, Ready>(b, qw, dot);
  vf ks[G], vs[G];
  for (int g = 0; g < G; ++g) ks[g] = load_vf(b.ks + g * kLanes), vs[g] = load_vf(b.vs + g * kLanes);
  const vi iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vf alpha[R], gain[R];
  for (int r = 0; r < R; ++r) {
    // The keys the row sees: the block's, up to its limit, from its first.
    const int64_t last = std::min<int64_t>(start + n - 1, limit != nullptr ? limit[r] : INT32_MAX);
    const int32_t from = first != nullptr ? first[r] : 0;
    vf s[G];
    vi seen[G];
    float top = m[r];
    for (int g = 0; g < G; ++g) {
      const vi key = iota + static_cast<int32_t>(start + g * kLanes);
      seen[g] = (key <= static_cast<int32_t>(last)) & (key >= from);
      s[g] = (static_cast<vf>(_mm512_cvtepi32_ps(dot[r][g])) * ks[g]) * f[r];
      if (cap2 != 0.0f) s[g] = soft_cap(s[g], cap2);
      top = std::max(top, _mm512_reduce_max_ps(static_cast<__m512>(seen[g] ? s[g] : splat(kNoMax))));
    }
    const vf mx = splat(top);
    alpha[r] = exp2_nonpositive(splat(m[r]) - mx);
    vf part{}, peak{};
    for (int g = 0; g < G; ++g) {
      const vf e = seen[g] ? exp2_nonpositive(s[g] - mx) : vf{};
      part = g == 0 ? e : part + e;  // the block sum's order (paged_attention.h)
      s[g] = e * vs[g];              // the probabilities times the values' scales
      peak = vmax(peak, s[g]);
    }
    m[r] = top;
    l[r] = l[r] * alpha[r][0] + lane_sum(part);
    // As 16-bit integers against the row's largest, and the factor that undoes it.
    // (A block whose largest is below 2^-100 of the row's maximum, 1, adds nothing: its
    // 16-bit scale would overflow a float.)
    const float most = _mm512_reduce_max_ps(static_cast<__m512>(peak));
    const vf to_int = splat(most > 0x1p-100f ? static_cast<float>(kInt16Max) / most : 0.0f);
    gain[r] = splat(most / static_cast<float>(kInt16Max));
    for (int g = 0; g < G; ++g) {
      const __m512i x = _mm512_cvtps_epi32(static_cast<__m512>(s[g] * to_int));  // to nearest even
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + r * kBlock + g * kLanes), _mm512_cvtepi32_epi16(x));
    }
  }
  // The probabilities times the values: RB rows' NC accumulators at a time (16 registers).
  constexpr int RB = std::max(1, std::min(R, static_cast<int>(16 / NC)));
  for (int r0 = 0; r0 < R; r0 += RB) {
    const int rb = std::min(RB, R - r0);
    __m512i x[RB][NC];
    int8_products<NC, RB, Ready>(b, pr, r0, rb, x);
    for (int i = 0; i < rb; ++i) {
      float* a = acc + (r0 + i) * d;
      for (int c = 0; c < NC; ++c) {
        const __m512 scaled = static_cast<__m512>(load_vf(a + c * kLanes) * alpha[r0 + i]);
        const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x[i][c]), static_cast<__m512>(gain[r0 + i]), scaled);
        _mm512_storeu_ps(a + c * kLanes, y);
      }
    }
  }
}

// ``rows`` rows (``q``: [rows, d], unscaled bf16 values; ``scale``: their scores' factor) over
// keys [key_begin, key_end) of ``run`` (key_begin a multiple of kChunk) on int8 pages, KV
// head ``h``, updating the rows' softmax state; the arguments as attend_run's. Each block of
// keys is gathered once for all the rows (and made ready for them, past kInt8Rows rows),
// then taken by up to kInt8Rows rows at a time.
template <int NC, typename G>
void int8_attend(const Layer<G>& geo, const QuantPages& qp, int64_t h, KeyRun run, int64_t key_begin, int64_t key_end,
                 const float* q, float scale, int64_t rows, const int32_t* limit, const int32_t* first, float cap2,
                 float* m, float* l, float* acc, Scratch& sc) {
  constexpr int64_t d = NC * kLanes;
  int32_t* qw = sc.int8_queries.data();
  float f[kRowBlock];
  for (int64_t r = 0; r < rows; ++r) f[r] = int8_query(q + r * d, d, scale, qw + r * (d / 2));
  int64_t lo = key_begin, hi = key_end;
  if (limit != nullptr) hi = std::min<int64_t>(hi, *std::max_element(limit, limit + rows) + 1);
  if (first != nullptr) lo = std::max<int64_t>(lo, *std::min_element(first, first + rows));
  Int8Block b(sc);
  uint16_t* pr = sc.int8_probs.data();
  const bool ready = rows > kInt8Rows;
  for (int64_t start = lo - lo % kBlock; start < hi; start += kBlock) {
    const int64_t n = std::min(kBlock, hi - start);
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
    if (ready) prepare_int8_block<NC>(b);
    for (int64_t r0 = 0; r0 < rows; r0 += kInt8Rows) {
      // Rows that see none of the block would keep their state as it is (acc * 1 + 0): skipped.
      bool any = false;
      for (int64_t r = r0; r < std::min(rows, r0 + kInt8Rows); ++r) {
        const int64_t last = std::min<int64_t>(start + n - 1, limit != nullptr ? limit[r] : INT32_MAX);
        any |= last >= std::max<int64_t>(start, first != nullptr ? first[r] : 0);
      }
      if (!any) continue;
      const int32_t* lim = limit != nullptr ? limit + r0 : nullptr;
      const int32_t* fst = first != nullptr ? first + r0 : nullptr;
      auto block = [&](auto rows_c, auto ready_c) {
        int8_block<NC, decltype(rows_c)::value, decltype(ready_c)::value>(
            b, start, n, qw + r0 * (d / 2), f + r0, lim, fst, cap2, m + r0, l + r0, acc + r0 * d, pr);
      };
      auto with_rows = [&](auto ready_c) {
        switch (std::min<int64_t>(kInt8Rows, rows - r0)) {
          case 1: block(std::integral_constant<int, 1>{}, ready_c); break;
          case 2: block(std::integral_constant<int, 2>{}, ready_c); break;
          case 3: block(std::integral_constant<int, 3>{}, ready_c); break;
          default: block(std::integral_constant<int, 4>{}, ready_c); break;
        }
      };
      if (ready) with_rows(std::true_type{});
      else with_rows(std::false_type{});
    }
  }
}
#endif

// int8_attend for head size ``d`` where rows of queries ``Q`` over ``qp``'s pages take it
// (int8_dots_for), else null.
template <typename G>
using Int8AttendFn = void (*)(const Layer<G>&, const QuantPages&, int64_t, KeyRun, int64_t, int64_t, const float*,
                              float, int64_t, const int32_t*, const int32_t*, float, float*, float*, float*, Scratch&);

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
