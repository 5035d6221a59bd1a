// The paged-attention kernel's bf16 products of probabilities and values on AVX-512 BF16
// (without AMX): where the queries and keys are bf16 pairs (pair_scores_for), a block's
// probabilities are rounded to bf16, as GPU FlashAttention and the AMX tiles round them, and
// multiplied with the values by vdpbf16ps, two keys per instruction: half the instructions of
// the float FMAs, and the values are never widened to float (they were, once per row pair).
//
// One order for every path: a row's output columns, from acc * alpha, take the block's keys
// by pairs (2j, 2j + 1) in order, each pair as vdpbf16ps adds it (key 2j + 1's product, then
// key 2j's, each rounded once). A decode row's narrow block and the prefill row of the same
// position (its block in the lanes) thus agree bit for bit; keys a row does not see have
// probability zero and add exactly nothing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_attention.h"

#if RADIXSERVE_VEC_BF16
#include <immintrin.h>

namespace radixserve_cpu::paged {

// Two keys' values ``a`` (key 2j) and ``b`` (key 2j + 1) as pairs of keys: word i of v[c]
// holds dimension 16 c + i of ``a`` (low half) and of ``b`` (high half). NC even.
template <int NC>
inline void pair_values(const uint16_t* a, const uint16_t* b, __m512i (&v)[NC]) {
  static_assert(NC % 2 == 0, "32 dimensions at a time");
  // Word w of a pair's 32 dimensions: dimension w / 2 of the first key (w even) or of the
  // second (bit 5 of the index picks permutex2var's second operand).
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int c = 0; c < NC; c += 2) {
    const __m512i x = _mm512_loadu_si512(a + c * kLanes), y = _mm512_loadu_si512(b + c * kLanes);
    v[c] = _mm512_permutex2var_epi16(x, lo, y);
    v[c + 1] = _mm512_permutex2var_epi16(x, hi, y);
  }
}

// The values of a block's first ``pairs`` pairs of keys as pairs of keys into ``tv``: word i
// of tv[(j * NC + c) * 16 ..] holds dimension 16 c + i of key 2j (low half) and of key
// 2j + 1 (high half); ``pair_of(j, v)`` makes pair j's NC vectors (pair_values' words).
template <int NC, typename PairOf>
inline void store_value_pairs(int64_t pairs, uint32_t* __restrict tv, PairOf&& pair_of) {
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i v[NC];
    pair_of(j, v);
    for (int c = 0; c < NC; ++c) _mm512_storeu_si512(tv + (j * NC + c) * kLanes, v[c]);
  }
}

// store_value_pairs for keys [0, n) of bf16 rows ``vrow``. A key past ``n`` (an odd block's
// last pair) is zeros. ``ahead(t)``: prefetch the next block's key t.
template <int NC, typename Ahead>
inline void value_pairs(const uint16_t* const* vrow, int64_t n, uint32_t* __restrict tv, Ahead&& ahead) {
  alignas(64) static constexpr uint16_t kZeros[NC * kLanes] = {};
  store_value_pairs<NC>((n + 1) / 2, tv, [&](int64_t j, __m512i (&v)[NC]) {
    ahead(2 * j), ahead(2 * j + 1);
    pair_values<NC>(vrow[2 * j], 2 * j + 1 < n ? vrow[2 * j + 1] : kZeros, v);
  });
}

// Rows-in-lanes probabilities ``p[t]`` (lane r: row r's probability of key t) as pairs: word
// r of pw[j * 16 ..] holds row r's probabilities of keys 2j (low half) and 2j + 1, rounded
// to bf16. ``n``: the block's keys; an odd block's last pair takes probability zero for the
// key past it.
inline void prob_pairs_rows(const vf* p, int64_t n, uint32_t* __restrict pw) {
  // Word w of the pair vector: row w / 2's probability of the first key (w even: the low
  // half of cvtne2ps's result) or of the second.
  alignas(64) static constexpr uint16_t kByRow[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i by_row = _mm512_load_si512(kByRow);
  for (int64_t j = 0; 2 * j < n; ++j) {
    const vf second = 2 * j + 1 < n ? p[2 * j + 1] : vf{};
    const __m512bh two = _mm512_cvtne2ps_pbh(static_cast<__m512>(second), static_cast<__m512>(p[2 * j]));
    _mm512_storeu_si512(pw + j * kLanes, _mm512_permutexvar_epi16(by_row, (__m512i)two));
  }
}

// Row-major probabilities (``ps[r * kBlock + t]``, R rows of a full block) rounded to bf16,
// row by row (``pr[r * kBlock + t]``): word j of a row's words is its pair of keys 2j, 2j + 1,
// the pair prob_pairs_narrow would put at pw[j * 16 + r].
template <int R>
inline void prob_rows_bf16(const float* ps, uint16_t* __restrict pr) {
  for (int r = 0; r < R; ++r) {
    for (int64_t g = 0; g < kBlock / kLanes; ++g) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(ps + r * kBlock + g * kLanes));
      std::memcpy(pr + r * kBlock + g * kLanes, &b, sizeof b);
    }
  }
}

// Row-major probabilities (``ps[r * kBlock + t]``, R rows of a full block) as the same pairs.
template <int R>
inline void prob_pairs_narrow(const float* ps, uint32_t* __restrict pw) {
  alignas(64) uint16_t rows[R * kBlock];
  prob_rows_bf16<R>(ps, rows);
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      std::memcpy(pw + j * kLanes + r, rows + r * kBlock + 2 * j, sizeof(uint32_t));
    }
  }
}

// acc rows [r, r + R) = acc * alpha + the block's probabilities (``pw``, prob_pairs_*) times
// its values (``tv``, value_pairs), over ``pairs`` pairs of keys: R * NC accumulators, the
// rows' probability pair broadcast, each pair's value vectors loaded once for the R rows.
// ``rescale`` false: every alpha is 1 (no row's maximum moved), and acc is taken as it is.
template <int NC, int R>
inline void accumulate_pairs(float* __restrict acc, int64_t r, const vf alpha, bool rescale, const uint32_t* pw,
                             const uint32_t* tv, int64_t pairs) {
  constexpr int64_t d = NC * kLanes;
  __m512 x[R][NC];
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < NC; ++c) {
      const vf a = load_vf(acc + (r + i) * d + c * kLanes);
      x[i][c] = static_cast<__m512>(rescale ? a * alpha[r + i] : a);
    }
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh v[NC];
    for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(tv + (j * NC + c) * kLanes);
    for (int i = 0; i < R; ++i) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[j * kLanes + r + i]));
      for (int c = 0; c < NC; ++c) x[i][c] = _mm512_dpbf16_ps(x[i][c], w, v[c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (r + i) * d + c * kLanes, x[i][c]);
  }
}

// accumulate_pairs for the R rows of a narrow block over a full block's values, each pair of
// keys' values made pairs in registers by ``pair_of(j, v)`` (value_pairs' words: from bf16
// rows as they lie in the pages, pair_values; from fp8 codes, paged_attention_fp8.h) and used
// at once by every row, not stored and loaded again; the rows' probabilities as
// prob_rows_bf16 leaves them (``pr``). The same chain per output as accumulate_pairs (so the
// same bits), R * NC of them side by side.
template <int NC, int R, typename PairOf>
inline void accumulate_value_pairs(float* __restrict acc, const vf alpha, const uint16_t* pr, PairOf&& pair_of) {
  constexpr int64_t d = NC * kLanes;
  __m512 x[R][NC];
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < NC; ++c) x[i][c] = static_cast<__m512>(load_vf(acc + i * d + c * kLanes) * alpha[i]);
  }
  for (int64_t j = 0; j < kBlock / 2; ++j) {
    __m512i v[NC];
    pair_of(j, v);
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, pr + i * kBlock + 2 * j, sizeof pair);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < NC; ++c) x[i][c] = _mm512_dpbf16_ps(x[i][c], w, (__m512bh)v[c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + i * d + c * kLanes, x[i][c]);
  }
}

// accumulate_pairs for rows [0, lanes): four rows at a time where the registers allow, then
// fewer (the arithmetic of a row is the same either way). Where no row's maximum moved (every
// alpha exactly 1, as in most blocks once the rows have seen many keys) acc is not
// multiplied: x * 1 is x, so the same bits, and a block's rows take fewer multiplies from
// the FMA ports.
template <int NC>
inline void accumulate_pair_rows(float* acc, int64_t lanes, const vf alpha, const uint32_t* pw, const uint32_t* tv,
                                 int64_t pairs) {
  const bool rescale = _mm512_cmp_ps_mask(static_cast<__m512>(alpha), _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
  int64_t r = 0;
  if constexpr (NC <= 4) {
    for (; r + 4 <= lanes; r += 4) accumulate_pairs<NC, 4>(acc, r, alpha, rescale, pw, tv, pairs);
  }
  if constexpr (NC <= 8) {
    for (; r + 2 <= lanes; r += 2) accumulate_pairs<NC, 2>(acc, r, alpha, rescale, pw, tv, pairs);
  }
  for (; r < lanes; ++r) accumulate_pairs<NC, 1>(acc, r, alpha, rescale, pw, tv, pairs);
}

}  // namespace radixserve_cpu::paged
#endif

namespace radixserve_cpu::paged {

// The values of bf16 runs as pairs of keys (value_pairs' words), made once per kernel call
// for the many rows of a prefill or an extend (RunBuffer). Made block by block, every block of
// kRowBlock rows pairs every value it reads again: a 2,048-token chunk of SmolLM2 is 384
// blocks per KV head over the same values, and the pairing was ~10 % of such a chunk's
// attention on the 2-core AMD VM (value_pairs' permutes and stores). A run's pairs lie still
// for the whole call, key pair j of KV head h at values(i, h) + j * d words; the words are
// value_pairs' own (a key past the run's end is zeros), so the outputs are the same bits.
class ValuePairs : public RunBuffer<uint32_t, ValuePairs> {
 public:
  using RunBuffer::RunBuffer;

  // Take ``run`` to be paired whole: its index, or -1 (its blocks pair their values).
  int64_t add(KeyRun run) { return take(run, kv_heads_ * head_words(run.len)); }

  // Thread ``t`` of a team of ``nt``: its share of the pairing (RunBuffer::share), over runs
  // of the pages ``L`` holds.
  template <typename KV>
  void pair_share(const Layer<KV>& L, int64_t t, int64_t nt) const {
    share(t, nt, [&](const ChunkTask& task) {
      pair_keys(L, run(task.run).pages, task.head, task.run, task.head, task.lo);
    });
  }

  // Pair the values of keys [lo, lo + kChunk) of run ``i`` (lo a multiple of kChunk) for its
  // KV head ``h``, read from the run ``pages`` of ``L`` for KV head ``from`` there (a pool's
  // pages, or a quantized run decoded whole: one page of one head, WholeRuns).
  template <typename KV>
  void pair_keys(const Layer<KV>& L, const int64_t* pages, int64_t from, int64_t i, int64_t h, int64_t lo) const {
#if RADIXSERVE_VEC_BF16
    alignas(64) static constexpr uint16_t kZeros[256] = {};
    const int64_t keys = std::min(run(i).len, lo + kChunk) - lo;
    const uint16_t* vrow[kChunk];
    L.offsets(pages, from, lo, keys,
              [&](int64_t t, int64_t off) { vrow[t] = reinterpret_cast<const uint16_t*>(L.v + off); });
    uint32_t* out = words(i) + h * head_words(run(i).len) + lo / 2 * d_;
    for (int64_t j = 0; 2 * j < keys; ++j) {
      const uint16_t* a = vrow[2 * j];
      const uint16_t* b = 2 * j + 1 < keys ? vrow[2 * j + 1] : kZeros;
      for (int64_t c = 0; c < d_; c += 2 * kLanes) {
        __m512i v[2];
        pair_values<2>(a + c, b + c, v);
        _mm512_storeu_si512(out + j * d_ + c, v[0]);
        _mm512_storeu_si512(out + j * d_ + c + kLanes, v[1]);
      }
    }
#else
    (void)L, (void)pages, (void)from, (void)i, (void)h, (void)lo;
#endif
  }

  // Run ``i``'s pairs of KV head ``h``: [ceil(len / 2), d] words.
  const uint32_t* values(int64_t i, int64_t h) const { return words(i) + h * head_words(run(i).len); }

 private:
  int64_t head_words(int64_t len) const { return (len + 1) / 2 * d_; }
};

}  // namespace radixserve_cpu::paged
