// Paged attention for the CPU: every new row of a ragged batch (decode rows and prefill
// chunks alike) attends over its sequence's history read from the KV pool's pages in
// place; sequences that share leading pages attend to them together (cascade attention in
// one pass).
//
// Why a kernel: in plain torch a step's attention is ~50 small ATen calls per layer (page
// gathers, padding and causal masks, a flash call per part, the LSE merge) whose fixed
// costs, not the arithmetic, were most of attention's time on a 2-core CPU. Here each
// layer is one call, and what is left is mostly reading the pages from memory.
//
// A group is sequences whose first pages are the same pages (a cached system prompt); a
// sequence sharing nothing is a group of one with no shared pages. A group's query rows are
// its members' new tokens times the query heads of one KV head (GQA/MQA: heads
// h*grp .. h*grp+grp-1 read KV head h). Work item = (group, KV head, block of rows):
//
//   1. the group's shared pages, read once for all the block's rows (they precede every
//      member's new tokens: no mask); an online softmax (FlashAttention) keeps per row the
//      running max m, the sum l and the unnormalised output acc;
//   2. each member's rows go on over its own pages from that state, causally: the row of
//      new token i sees its own keys up to and including its own position;
//   3. out = acc / l, or with attention sinks (gpt-oss: a learned logit per query head
//      that joins the softmax's denominator and has no value) out = acc / (l + 2^(sink - m)),
//      the sink added once per row and head after every key's chunk is merged, so a decode
//      row and the prefill row of its position still agree bit for bit.
//
// Keys are taken in chunks of kChunk from the start of each run (the shared pages, then a
// member's own pages): every chunk's softmax state starts from nothing and the chunks' states
// are merged in key order (m = max(m1, m2), l and acc rescaled by 2^(m1 - m), 2^(m2 - m)).
// That fixes every row's summation order whatever runs where: a batch-1 decode step, whose
// few items (one per KV head) would leave a thread idle, spreads its chunks over the
// threads and merges them afterwards (flash-decoding), while a prefill row computes and
// merges the same chunks one after the other, so that a decode row and the prefill row of
// the same position still agree bit for bit.
//
// Softmax runs in base 2 (scores scaled by sm_scale * log2 e) with a polynomial exp2 that the
// compiler vectorises. float queries are pre-scaled; bf16 queries over bf16 keys are scored
// by pairs of dimensions (pair_scores_for below) and their scores scaled after, on AMX tiles
// where the CPU has them (amx_attend), with AVX-512 instructions elsewhere.
//
// Its parts: paged_attention.h (shared types and helpers), paged_attention_narrow.h (AVX-512
// blocks of a few rows), paged_attention_amx.h (AMX tiles), paged_attention_quant.h,
// paged_attention_fp8.h and paged_attention_int8.h (quantized pages: decoded, fp8 read in
// place by the narrow blocks, or int8 in integer products), store_kv.cpp
// (the new rows into the pages); this file holds the rows-in-lanes path, the work plan and the op.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include "amx.h"
#include "paged_attention.h"
#include "paged_attention_amx.h"
#include "paged_attention_fp8.h"
#include "paged_attention_int8.h"
#include "paged_attention_narrow.h"
#include "paged_attention_pairs.h"
#include "paged_attention_quant.h"
#include "store_kv.h"
#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace radixserve_cpu;
using namespace radixserve_cpu::paged;

// Attend ``rows`` query rows (``q``: [rows, d]; pre-scaled, base 2, or with ``Pairs`` bf16
// values whose scores are scaled by ``scale``) over keys [key_begin, key_end) of ``run``
// (key_begin a multiple of kBlock), updating the online-softmax state rows ``m``, ``l``,
// ``acc``; ``kLanes`` rows at a time.
// The rows ride in the lanes of a vector (vec.h): scores of all of them against one key are
// D broadcast-FMAs, with no transposition of the keys and no horizontal sums; the
// statistics m and l are vectors too.
// ``limit``: per row, the last key of the run it may see (causal), or null: all of them.
// ``first``: per row, the first key it may see (a sliding window), or null: from the run's
// start; blocks wholly before every row's first key are not read.
// ``cap2`` > 0: scores become cap2 * tanh(score / cap2) (Gemma 2's soft-cap, in the log2
// domain). The AMX tiles and the narrow blocks take neither quirk: such calls score here.
// ``NC``: head_dim / kLanes, fixed at compile time so the inner loops unroll into registers.
// (soft_cap: paged_attention.h.)

// Scores of ``n`` keys (float rows ``kr``) for the rows in the lanes (``qt``: the queries
// transposed, pre-scaled), eight keys at a time: eight independent FMA chains over the
// dimensions in order. ``ahead(t)``: prefetch the next block's key t.
template <int NC, typename Ahead>
inline void score_rows(const vf* qt, const float* const* kr, int64_t n, vf* p, Ahead&& ahead) {
  constexpr int64_t d = NC * kLanes;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    for (int64_t u = t; u < t + 8; ++u) ahead(u);
    vf a[8] = {};
    for (int64_t j = 0; j < d; ++j) {
      for (int u = 0; u < 8; ++u) a[u] += qt[j] * kr[t + u][j];
    }
    for (int u = 0; u < 8; ++u) p[t + u] = a[u];
  }
  for (; t < n; ++t) {
    ahead(t);
    vf a{};
    for (int64_t j = 0; j < d; ++j) a += qt[j] * kr[t][j];
    p[t] = a;
  }
}

#if RADIXSERVE_VEC_BF16
// pair_scores_for's scores of ``n`` bf16 keys as they lie in the pages (``kw``: each key's
// d / 2 words of two dimensions) for the rows in the lanes (``qp[j]`` lane r: row r's pair
// j), scaled after: one vdpbf16ps per pair of dimensions, the key's pair broadcast from the
// page, the same instruction and order as narrow_block's (so a decode row's narrow block and
// the prefill row of its position still agree bit for bit), eight keys at a time. Half the
// instructions of two float FMAs per pair, and the keys are never converted to float.
// ``top``: the lanes' maximum of itself and every score (the block's maximum for the softmax,
// taken as the scores come rather than in a pass of its own: max is exact, so the same bits).
template <int NC, typename Ahead>
inline void score_pairs(const __m512i* qp, const uint32_t* const* kw, int64_t n, float scale, vf* p, vf& top,
                        Ahead&& ahead) {
  constexpr int64_t pairs = NC * kLanes / 2;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    for (int64_t u = t; u < t + 8; ++u) ahead(u);
    __m512 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {
      const __m512bh qj = (__m512bh)qp[j];
      for (int u = 0; u < 8; ++u) {
        a[u] = _mm512_dpbf16_ps(a[u], (__m512bh)_mm512_set1_epi32(static_cast<int>(kw[t + u][j])), qj);
      }
    }
    for (int u = 0; u < 8; ++u) p[t + u] = static_cast<vf>(a[u]) * scale;
    const vf m01 = vmax(p[t], p[t + 1]), m23 = vmax(p[t + 2], p[t + 3]);
    const vf m45 = vmax(p[t + 4], p[t + 5]), m67 = vmax(p[t + 6], p[t + 7]);
    top = vmax(top, vmax(vmax(m01, m23), vmax(m45, m67)));
  }
  for (; t < n; ++t) {
    ahead(t);
    __m512 a = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32(static_cast<int>(kw[t][j])), (__m512bh)qp[j]);
    }
    p[t] = static_cast<vf>(a) * scale;
    top = vmax(top, p[t]);
  }
}
#endif

// The queries of up to kLanes rows (``q`` from row ``r0``, ``lanes`` of them) in the forms
// attend_run's blocks read, each built when a block first needs it: transposed floats for
// the rows-in-lanes FMAs, and with Pairs (bf16 values: the top halves of the floats' bits are
// the bf16 words) a narrow block's rows as pairs, and the rows' pairs with the rows in the
// lanes. Narrow blocks need no transposition, and building it is ~1,500 cycles (a vector
// load over fresh scalar stores per dimension), the cost of ~15 keys.
template <int NC, bool Pairs>
class RowQueries {
 public:
  static constexpr int64_t d = NC * kLanes;

  RowQueries(const float* q, int64_t r0, int64_t lanes) : q_(q + r0 * d), lanes_(lanes) {}

  // qt[j] lane r = q[r][j].
  const vf* transposed() {
    if (!have_qt_) {
      for (int64_t j = 0; j < d; ++j) {
        float col[kLanes] = {};
        for (int64_t r = 0; r < lanes_; ++r) col[r] = q_[r * d + j];
        qt_[j] = load_vf(col);
      }
      have_qt_ = true;
    }
    return qt_;
  }

  // Row r's pair j at [r * d / 2 + j] (a narrow block's rows).
  const uint32_t* pairs() {
    if (!have_qw_) {
      for (int64_t r = 0; r < lanes_; ++r) {
        for (int64_t j = 0; j < d / 2; ++j) qw_[r * (d / 2) + j] = bf16_pair(q_ + r * d + 2 * j);
      }
      have_qw_ = true;
    }
    return qw_;
  }

#if RADIXSERVE_VEC_BF16
  // qp[j] lane r: row r's pair j (zero past ``lanes``). Each row's floats made pairs by one
  // exact conversion per 32, then the rows' pairs transposed 16 at a time (a scalar pair per
  // row and word was ~10 % of a prefill chunk's attention on the 2-core AMD VM).
  const __m512i* lane_pairs() {
    if (!have_qp_) {
      alignas(64) uint32_t words[kLanes][d / 2];
      const float* rows16[kLanes];
      for (int64_t r = 0; r < kLanes; ++r) {
        for (int64_t j = 0; j < d / 2; j += kLanes) {
          __m512i w = _mm512_setzero_si512();
          if (r < lanes_) {
            const float* x = q_ + r * d + 2 * j;
            w = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + kLanes), _mm512_loadu_ps(x));
          }
          _mm512_store_si512(words[r] + j, w);
        }
        rows16[r] = reinterpret_cast<const float*>(words[r]);
      }
      for (int64_t c = 0; c < d / 2; c += kLanes) {
        __m512 t[16];
        transpose16(rows16, c, t);
        for (int64_t j = 0; j < kLanes; ++j) qp_[c + j] = _mm512_castps_si512(t[j]);
      }
      have_qp_ = true;
    }
    return qp_;
  }
#endif

 private:
  const float* q_;
  int64_t lanes_;
  bool have_qt_ = false, have_qw_ = false, have_qp_ = false;
  vf qt_[d];
  uint32_t qw_[Pairs ? kNarrowRows * d / 2 : 1];
#if RADIXSERVE_VEC_BF16
  __m512i qp_[Pairs ? d / 2 : 1];
#endif
};

// Which keys of [key_begin, key_end) the rows r0 .. r0 + lanes - 1 see, from their causal
// ``limit`` (the last key, or null: all) and window ``first`` (the first key, or null: from
// key_begin): the lanes' bounds as vectors, and the keys every lane sees or none does.
struct RowBounds {
  int64_t keys;       // past the last key any lane sees: no key from here on is read
  int64_t lim_min;    // keys up to here are seen by every lane (as far as ``first`` allows)
  int64_t first_min;  // keys before here are seen by no lane, and not read
  int64_t first_max;  // keys from here on are seen by every lane (as far as ``limit`` allows)
  vi vlim, vfirst;    // each lane's last and first key (lanes past ``lanes``: harmless bounds)

  RowBounds(const int32_t* limit, const int32_t* first, int64_t r0, int64_t lanes, int64_t key_begin,
            int64_t key_end)
      : keys(key_end),
        lim_min(key_end - 1),
        first_min(key_begin),
        first_max(key_begin),
        vlim(vi{} + static_cast<int32_t>(key_end - 1)),
        vfirst{} {
    if (limit != nullptr) {
      int32_t lim[kLanes];
      const int32_t* lo = std::min_element(limit + r0, limit + r0 + lanes);
      const int32_t* hi = std::max_element(limit + r0, limit + r0 + lanes);
      for (int64_t r = 0; r < kLanes; ++r) lim[r] = r < lanes ? limit[r0 + r] : *hi;
      std::memcpy(&vlim, lim, sizeof vlim);
      lim_min = *lo;
      keys = std::min<int64_t>(keys, *hi + 1);
    }
    if (first != nullptr) {
      int32_t fs[kLanes];
      const int32_t* lo = std::min_element(first + r0, first + r0 + lanes);
      for (int64_t r = 0; r < kLanes; ++r) fs[r] = r < lanes ? first[r0 + r] : *lo;
      std::memcpy(&vfirst, fs, sizeof vfirst);
      first_min = std::max<int64_t>(key_begin, *lo);
      first_max = *std::max_element(first + r0, first + r0 + lanes);
    }
  }

  // Per lane, whether it sees ``key``.
  vi seen(int64_t key) const {
    const vi k = vi{} + static_cast<int32_t>(key);
    return (k <= vlim) & (k >= vfirst);
  }
  // Whether some lane of a block [start, start + n) does not see all of it.
  bool masked(int64_t start, int64_t n) const { return start + n - 1 > lim_min || start < first_max; }
};

// A rows-in-lanes block's online-softmax step over its scores ``p`` (``n`` keys from
// ``start``; with ``masked`` the keys a lane does not see take no part): the soft-cap where
// ``cap2`` is set, the lanes' maximum (``top``: the scores' maximum as scored, which a mask
// or the cap changes), the probabilities in ``p`` (zero past ``n``), their sum in the block
// sum's order (paged_attention.h) and the rescaled state ``vm``, ``vl``. Returns the factor
// alpha the rows' accumulators take before the block's products.
template <bool Pairs>
inline vf block_softmax(vf (&p)[kBlock], int64_t n, int64_t start, const RowBounds* masked, float cap2, vf top, vf& vm,
                        vf& vl) {
  int64_t t = 0;
  if (cap2 != 0.0f) {
    for (t = 0; t < n; ++t) p[t] = soft_cap(p[t], cap2);
  }
  if (masked != nullptr) {
    for (t = 0; t < n; ++t) p[t] = masked->seen(start + t) ? p[t] : splat(kNoMax);
  }
  vf mx = top;
  if (!Pairs || masked != nullptr || cap2 != 0.0f) {
    mx = vm;
    for (t = 0; t < n; ++t) mx = vmax(mx, p[t]);
  }
  const vf alpha = exp2_nonpositive(vm - mx);
  for (t = 0; t < n; ++t) {
    p[t] = exp2_nonpositive(p[t] - mx);
    if (masked != nullptr) p[t] = masked->seen(start + t) ? p[t] : vf{};
  }
  for (; t < kBlock; ++t) p[t] = vf{};  // keys past a short block's end
  vm = mx;
  vl = vl * alpha + block_sum(p);
  return alpha;
}

template <int NC, typename KV, bool Pairs>
void attend_run(const Layer<KV>& L, int64_t h, KeyRun run, int64_t key_begin, int64_t key_end,
                const float* __restrict q, float scale, int64_t rows, const int32_t* limit, const int32_t* first,
                float cap2, float* __restrict m, float* __restrict l, float* __restrict acc, Scratch& sc) {
#if RADIXSERVE_AMX
  if constexpr (Pairs) {
    if (amx_usable() && first == nullptr && cap2 == 0.0f) {
      return amx_attend<NC>(L, h, run, key_begin, key_end, q, scale, rows, limit, m, l, acc, sc);
    }
  }
#endif
  constexpr int64_t d = NC * kLanes;
  const KV* krow[kBlock];
  const KV* vrow[kBlock];
  const float* kr[kBlock];
  const float* vr[kBlock];
  int64_t next[kBlock];  // offsets of the next block's rows
  vf p[kBlock];          // scores, then probabilities: p[t] lane r
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    const int64_t lanes = std::min(kLanes, rows - r0);
    RowQueries<NC, Pairs> queries(q, r0, lanes);
    float mv[kLanes], lv[kLanes];
    for (int64_t r = 0; r < kLanes; ++r) {
      mv[r] = r < lanes ? m[r0 + r] : kNoMax;
      lv[r] = r < lanes ? l[r0 + r] : 0.0f;
    }
    vf vm = load_vf(mv), vl = load_vf(lv);
    const RowBounds bounds(limit, first, r0, lanes, key_begin, key_end);
    const int64_t keys = bounds.keys;
    for (int64_t start = bounds.first_min; start < keys; start += kBlock) {
      const int64_t n = std::min(kBlock, keys - start);
      const bool masked = bounds.masked(start, n);
      const bool narrow = lanes <= kNarrowRows && n == kBlock && !masked && cap2 == 0.0f;
#if RADIXSERVE_FP8_BYTES
      if constexpr (kFp8InPlace<NC, Pairs>) {
        if (narrow && sc.fp8 != nullptr) {  // fp8 codes read where they lie: nothing to fill or gather here
          const uint32_t* qw = queries.pairs();
          const int64_t next_n = sc.streaming ? 0 : std::min(kBlock, keys - start - n);
          with_narrow_rows(lanes, [&](auto rows_c) {
            fp8_narrow_block<NC, decltype(rows_c)::value>(*sc.fp8, start, next_n, qw, scale, vm, vl, acc + r0 * d, sc);
          });
          continue;
        }
      }
#endif
      if (sc.fill.fn != nullptr) sc.fill.fn(sc.fill.ctx, start, n);
      L.offsets(run.pages, h, start, n, [&](int64_t t, int64_t off) {
        krow[t] = L.k + off;
        vrow[t] = L.v + off;
      });
      // The next block's rows are prefetched a key at a time while this block's keys are
      // scored (or, in narrow_block, transposed): a burst would overflow the miss queues.
      // Worth 2-4 % on the 2-core VM with the keys coming from memory; prefetching into L1
      // instead of L2, or twice as far ahead, measured the same (benchmarks/README.md,
      // "Weights on huge pages, decode attention with the keys in the lanes").
      // (Not while the thread streams its next chunk instead: ``ahead`` then reads no offset.)
      const int64_t next_n = sc.streaming ? 0 : std::min(kBlock, keys - start - n);
      L.offsets(run.pages, h, start + n, next_n, [&](int64_t t, int64_t off) { next[t] = off; });
      if constexpr (std::is_same_v<KV, float>) {
        std::copy(krow, krow + n, kr);
        std::copy(vrow, vrow + n, vr);
      } else {
        // Keys as float rows unless they are read as they lie (narrow blocks of bf16 keys;
        // rows-in-lanes blocks scoring bf16 pairs natively); values likewise, unless the
        // products widen them (narrow_widens) on either path.
        if (narrow ? narrow_reads_rows<NC, KV> : !Pairs) {
          const float* kb = block_rows(krow, n, d, sc.kf.data());
          for (int64_t t = 0; t < n; ++t) kr[t] = kb + t * d;
        }
        if (!narrow_widens<KV>) {
          const float* vb = block_rows(vrow, n, d, sc.vf_.data());
          for (int64_t t = 0; t < n; ++t) vr[t] = vb + t * d;
        }
      }
      // The values as they lie where the products widen them (float, bf16), else converted.
      const auto values = [&] {
        if constexpr (narrow_widens<KV>) return static_cast<const KV* const*>(vrow);
        else return static_cast<const float* const*>(vr);
      }();
#if defined(__AVX512F__)
      if (narrow) {
        auto ahead = [&](int64_t t) {
          if (sc.streaming) sc.stream.step();
          else if (t < next_n) prefetch_row(L, next[t]);
        };
        float* acc0 = acc + r0 * d;
        const float* q0 = q + r0 * d;
        const uint32_t* qw = nullptr;
        if constexpr (Pairs) qw = queries.pairs();
        with_narrow_rows(lanes, [&](auto rows_c) {
          narrow_block<NC, decltype(rows_c)::value, Pairs>(krow, kr, values, q0, qw, scale, vm, vl, acc0, sc, ahead);
        });
        continue;
      }
#endif
      // (Only the keys where the values are paired for the call: their rows are not read.)
      auto ahead = [&](int64_t t) {
        if (sc.streaming) sc.stream.step();
        else if (t < next_n) prefetch_row(L, next[t], run.vpairs == nullptr);
      };
      vf top = vm;
      if constexpr (Pairs) {
#if RADIXSERVE_VEC_BF16
        score_pairs<NC>(queries.lane_pairs(), reinterpret_cast<const uint32_t* const*>(krow), n, scale, p, top, ahead);
#endif
      } else {
        score_rows<NC>(queries.transposed(), kr, n, p, ahead);
      }
      const vf alpha = block_softmax<Pairs>(p, n, start, masked ? &bounds : nullptr, cap2, top, vm, vl);
#if RADIXSERVE_VEC_BF16
      if constexpr (Pairs) {
        // The values as pairs of keys: paired for the call (``start`` is even: no window), or here.
        const uint32_t* tv = run.vpairs != nullptr ? run.vpairs + start / 2 * d : sc.pv.data();
        if (run.vpairs == nullptr) {
          value_pairs<NC>(reinterpret_cast<const uint16_t* const*>(vrow), n, sc.pv.data(), [](int64_t) {});
        }
        prob_pairs_rows(p, n, sc.pw.data());
        accumulate_pair_rows<NC>(acc + r0 * d, lanes, alpha, sc.pw.data(), tv, (n + 1) / 2);
        continue;
      }
#endif
      accumulate_rows<NC>(acc + r0 * d, lanes, alpha, [&](int64_t t, int64_t r) { return p[t][r]; }, values, n);
    }
    for (int64_t r = 0; r < lanes; ++r) {
      m[r0 + r] = vm[r];
      l[r0 + r] = vl[r];
    }
  }
}

template <typename KV>
using AttendFn = void (*)(const Layer<KV>&, int64_t, KeyRun, int64_t, int64_t, const float*, float, int64_t,
                          const int32_t*, const int32_t*, float, float*, float*, float*, Scratch&);

// The largest head size attend_fn serves.
constexpr int64_t kMaxHeadDim = 256;

// The head sizes of the models served (16 .. 256; 16 for the tests' tiny models), for
// queries of dtype Q.
template <typename Q, typename KV>
AttendFn<KV> attend_fn(int64_t d) {
  switch (d) {
    case 16: return attend_run<1, KV, pair_scores_for<Q, KV>(16)>;
    case 32: return attend_run<2, KV, pair_scores_for<Q, KV>(32)>;
    case 64: return attend_run<4, KV, pair_scores_for<Q, KV>(64)>;
    case 80: return attend_run<5, KV, pair_scores_for<Q, KV>(80)>;
    case 96: return attend_run<6, KV, pair_scores_for<Q, KV>(96)>;
    case 128: return attend_run<8, KV, pair_scores_for<Q, KV>(128)>;
    case 256: return attend_run<16, KV, pair_scores_for<Q, KV>(256)>;
    default: return nullptr;
  }
}

// The batch's index arrays (see paged_attention below).
struct Plan {
  const int64_t *q_start, *new_len, *group_start, *shared_pages, *shared_start, *own_pages, *own_start, *own_len;
};

struct Item {
  int64_t group, head, row_begin, row_end;  // rows of the group: member by member, token by token, head by head
};

// One item's softmax state for its rows: ``m``, ``l`` [rows], ``acc`` [rows, d].
struct State {
  float* m;
  float* l;
  float* acc;
};

// Merge the state of a later chunk (``b``) into ``a``, row by row: the one order in which
// every path combines chunks. A row that saw no key of ``b`` (m = kNoMax, l = 0, acc = 0)
// keeps ``a`` exactly (its own factor is 2^0 = 1), and merging into a state that saw nothing
// yet gives ``b`` exactly, so skipping such merges changes no bit.
// Not inlined: one compiled body for both callers, so that no call site contracts or
// vectorises the arithmetic differently from the other.
__attribute__((noinline)) void merge_state(State a, State b, int64_t rows, int64_t d) {
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    const int64_t lanes = std::min(kLanes, rows - r0);
    float am[kLanes], bm[kLanes], al[kLanes], bl[kLanes];
    for (int64_t r = 0; r < kLanes; ++r) {
      am[r] = r < lanes ? a.m[r0 + r] : 0.0f;
      bm[r] = r < lanes ? b.m[r0 + r] : 0.0f;
      al[r] = r < lanes ? a.l[r0 + r] : 0.0f;
      bl[r] = r < lanes ? b.l[r0 + r] : 0.0f;
    }
    const vf ma = load_vf(am), mb = load_vf(bm), mx = vmax(ma, mb);
    const vf fa = exp2v(ma - mx), fb = exp2v(mb - mx);
    const vf l = load_vf(al) * fa + load_vf(bl) * fb;
    for (int64_t r = 0; r < lanes; ++r) {
      a.m[r0 + r] = mx[r];
      a.l[r0 + r] = l[r];
      float* x = a.acc + (r0 + r) * d;
      const float* y = b.acc + (r0 + r) * d;
      for (int64_t j = 0; j < d; ++j) x[j] = x[j] * fa[r] + y[j] * fb[r];
    }
  }
}

// Below this many lane-multiply-adds (an item's row vectors x its keys x head_dim; a decode
// row of SmolLM2 over ~85 keys, ~10 us) a call runs on the calling thread: forking and
// joining the OpenMP team costs a few microseconds when the threads are awake, and much more
// when a busy machine has descheduled one of them. Above it two threads win even for a short
// context, because a decode step's keys come from memory (the weights streamed since the
// layer last read them): two threads keep twice the misses in flight. On the 2-core VM, a
// decode row over 160-340 keys took 20-42 % less time split than on one thread
// (benchmarks/bench_decode_attention.py); at 32 keys splitting lost.
constexpr int64_t kSerialWork = int64_t{1} << 18;

// A core's L2 in bytes (1 MiB where the system does not say).
int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return n > 0 ? static_cast<int64_t>(n) : int64_t{1} << 20;
  }();
  return bytes;
}

// Where the pages read ahead of attending land (Kernel::read_first): a sink the compiler
// cannot prove unused.
std::atomic<uint64_t> touch_sink{0};

// Work [0, n) split over a team of ``nt`` threads, as thread ``t`` (0 <= t < nt) visits it:
// work(i, true) for its own run [n t / nt, n (t + 1) / nt), in order, then work(i, false) for
// the others' runs, each from its end. Every thread visits every index: the caller claims
// each (an atomic flag) so that it runs once, and a thread held up (preempted, on a busy
// machine) delays the team by what it holds, not by its whole run.
template <typename Work>
void for_runs(int64_t n, int64_t t, int64_t nt, Work&& work) {
  for (int64_t i = n * t / nt; i < n * (t + 1) / nt; ++i) work(i, true);
  for (int64_t o = 1; o < nt; ++o) {
    const int64_t u = (t + o) % nt;
    for (int64_t i = n * (u + 1) / nt - 1; i >= n * u / nt; --i) work(i, false);
  }
}

template <typename Q, typename KV>
struct Kernel {
  const Layer<KV> L;
  const Plan& P;
  const Q* qd;
  int64_t q_row, q_head;  // q may be a view of the fused qkv projection
  Q* od;
  int64_t hq, grp;
  float scale;
  AttendFn<KV> attend;
  int64_t window;  // the layer's sliding window (0: none)
  float cap2;      // the scores' soft-cap in the log2 domain (0: none)
  // Quantized pages (then ``L`` holds only their geometry and KV is the queries' dtype, the
  // dtype they are decoded to), or null.
  const QuantPages* quant = nullptr;
  // Quantized runs decoded whole for this call (WholeRuns), and each run's index among them:
  // per group its shared run's, per member its own run's; -1 (or null arrays): in the per-thread tile.
  const WholeRuns<KV>* whole = nullptr;
  const int64_t* shared_whole = nullptr;
  const int64_t* own_whole = nullptr;
  // bf16 runs whose values are paired for this call (ValuePairs), each run's index among
  // them as ``whole``'s; null arrays: none (every block pairs its values).
  const ValuePairs* pairs = nullptr;
  const int64_t* shared_pairs = nullptr;
  const int64_t* own_pairs = nullptr;
  // int8 pages read by bf16 queries in integer arithmetic (paged_attention_int8.h), or null;
  // its runs made ready whole for this call (indexed as ``whole``'s), or null.
  Int8AttendFn<KV> int8 = nullptr;
  const Int8Runs* int8_runs = nullptr;
  // Each query head's attention sink in the log2 domain (sink * log2 e), or null: none.
  const float* sinks2 = nullptr;

  // Run ``index[i]``'s values of KV head ``h`` as pairs, or null where it was not paired.
  const uint32_t* paired(const int64_t* index, int64_t i, int64_t h) const {
    return index != nullptr && index[i] >= 0 ? pairs->values(index[i], h) : nullptr;
  }

  int64_t shared_len(const Item& item) const {
    return (P.shared_start[item.group + 1] - P.shared_start[item.group]) * L.page_size;
  }

  // The item's first member and the row of that member's block where the item starts.
  std::pair<int64_t, int64_t> first_member(const Item& item) const {
    int64_t mi = P.group_start[item.group], skip = item.row_begin;
    while (skip >= P.new_len[mi] * grp) skip -= P.new_len[mi++] * grp;
    return {mi, skip};
  }

  // Chunks of the item's keys: the shared run's, then those of the longest own run among
  // its members (a member whose own run is shorter sees nothing in the last ones).
  int64_t chunks(const Item& item) const {
    auto [mi, skip] = first_member(item);
    int64_t own = 0;
    for (int64_t r = item.row_begin; r < item.row_end; ++mi) {
      own = std::max(own, P.own_len[mi]);
      r += P.new_len[mi] * grp - skip;
      skip = 0;
    }
    return (shared_len(item) + kChunk - 1) / kChunk + (own + kChunk - 1) / kChunk;
  }

  // The item's query rows (pre-scaled, or as they are where pair_scores_for scales the scores
  // after) and causal limits into ``sc``.
  void load_rows(const Item& item, Scratch& sc) const {
    const int64_t d = L.d, h = item.head, rows = item.row_end - item.row_begin;
    const bool unscaled = pair_scores_for<Q, KV>(d);
    auto [mi, skip] = first_member(item);
    for (int64_t r = 0; r < rows; ++r, ++skip) {
      if (skip == P.new_len[mi] * grp) skip = 0, ++mi;
      const int64_t t = skip / grp, head = h * grp + skip % grp;
      const Q* src = qd + (P.q_start[mi] + t) * q_row + head * q_head;
      float* row = sc.q.data() + r * d;
      for (int64_t j = 0; j < d; ++j) row[j] = to_float(src[j]);
      // Rotated rows rounded back to Q: every path then reads values of Q's dtype, as it
      // does unrotated rows (some take the row's floats, others its Q words: the same bits).
      if (rotated()) {
        hadamard_rotate(row, d);
        for (int64_t j = 0; j < d; ++j) row[j] = to_float(from_float<Q>(row[j]));
      }
      if (!unscaled) {
        for (int64_t j = 0; j < d; ++j) row[j] *= scale;
      }
      sc.limit[r] = static_cast<int32_t>(P.own_len[mi] - P.new_len[mi] + t);
      sc.first[r] = window > 0 ? std::max<int32_t>(0, sc.limit[r] - static_cast<int32_t>(window) + 1) : 0;
    }
  }

  // f(pages, first, last) for the pages pages[first..last] that chunk ``c`` of the item's keys
  // lie on: the group's shared run's, or every member's own run's.
  template <typename F>
  void chunk_pages(const Item& item, int64_t c, F&& f) const {
    auto keys = [&](const int64_t* pages, int64_t begin, int64_t end) {
      if (end > begin) f(pages, begin / L.page_size, (end - 1) / L.page_size);
    };
    const int64_t shared = shared_len(item), shared_chunks = (shared + kChunk - 1) / kChunk;
    if (c < shared_chunks) {
      keys(P.shared_pages + P.shared_start[item.group], c * kChunk, std::min(shared, (c + 1) * kChunk));
      return;
    }
    const int64_t begin = (c - shared_chunks) * kChunk;
    for (int64_t mi = P.group_start[item.group]; mi < P.group_start[item.group + 1]; ++mi) {
      keys(P.own_pages + P.own_start[mi], begin, std::min(P.own_len[mi], begin + kChunk));
    }
  }

  // f(pages, first, last) for every page group ``g`` attends to: its shared run, its members'.
  template <typename F>
  void group_pages(int64_t g, F&& f) const {
    const int64_t shared_pages = P.shared_start[g + 1] - P.shared_start[g];
    if (shared_pages > 0) f(P.shared_pages + P.shared_start[g], 0, shared_pages - 1);
    for (int64_t mi = P.group_start[g]; mi < P.group_start[g + 1]; ++mi) {
      if (P.own_len[mi] > 0) f(P.own_pages + P.own_start[mi], 0, (P.own_len[mi] - 1) / L.page_size);
    }
  }

  // Read the pages that ``visit`` names (visit(f) calls f(pages, first, last) for runs of
  // them), K then V, a word per cache line, when they fit in half this core's L2 (else they
  // would not stay until their turn). The kernel's own loads come amid its arithmetic, too
  // few at a time to keep the memory busy; a plain pass streams at the core's read rate.
  // Whether it read them.
  template <typename Visit>
  bool read_first(Visit&& visit) const {
    int64_t bytes = 0;
    visit([&](const int64_t*, int64_t first, int64_t last) {
      bytes += 2 * (last - first + 1) * (page_bytes() + page_scale_bytes());
    });
    if (bytes > l2_bytes() / 2) return false;
    read_pages(visit);
    return true;
  }

  int64_t page_bytes() const {
    const int64_t row = quant != nullptr ? quant->bytes(L.d) : L.d * static_cast<int64_t>(sizeof(KV));
    return L.page_size * L.kv_heads * row;
  }

  // A page's int8 or int4 scales (one float per slot and KV head); 0 where the pages have
  // none of their own.
  int64_t page_scale_bytes() const {
    return quant != nullptr && token_scaled(quant->codes) ? L.page_size * L.kv_heads * int64_t{sizeof(float)} : 0;
  }

  // Whether the pages hold Hadamard-rotated rows (int4): each query row is rotated as it is
  // loaded and each output row as it is written (hadamard_rotate).
  bool rotated() const { return quant != nullptr && quant->codes == Codes::kInt4; }

  // f(start, bytes) for the pages that ``visit`` names, K then V of each run of them, then
  // their int8 or int4 scales, K's then V's: a page's scales are read with its codes, and lie in
  // another tensor; not prefetched, each page's few lines of them were waited on, one miss
  // at a time, amid the decoding.
  template <typename Visit, typename F>
  void page_bytes_of(Visit&& visit, F&& f) const {
    const int64_t page_bytes = this->page_bytes(), scale_bytes = page_scale_bytes();
    visit([&](const int64_t* pages, int64_t first, int64_t last) {
      const void* pools[2] = {L.k, L.v};
      if (quant != nullptr) pools[0] = quant->k, pools[1] = quant->v;
      for (const void* pool : pools) {
        for (int64_t pg = first; pg <= last; ++pg) f(reinterpret_cast<const char*>(pool) + pages[pg] * page_bytes, page_bytes);
      }
      if (scale_bytes == 0) return;
      for (const float* scales : {quant->k_scale, quant->v_scale}) {
        for (int64_t pg = first; pg <= last; ++pg) {  // the whole cache lines the page's scales touch
          const uintptr_t start = reinterpret_cast<uintptr_t>(scales) + pages[pg] * scale_bytes;
          const uintptr_t line = start & ~uintptr_t{63}, end = (start + scale_bytes + 63) & ~uintptr_t{63};
          f(reinterpret_cast<const char*>(line), static_cast<int64_t>(end - line));
        }
      }
    });
  }

  // read_first's pass, whatever the size.
  template <typename Visit>
  void read_pages(Visit&& visit) const {
    uint64_t acc = 0;
    page_bytes_of(visit, [&](const char* base, int64_t bytes) {
      for (int64_t b = 0; b < bytes; b += 64) {
        uint64_t word;
        std::memcpy(&word, base + b, sizeof word);  // one load; no type-punned pointer
        acc ^= word;
      }
    });
    touch_sink.fetch_xor(acc, std::memory_order_relaxed);  // kept: the loads stay
  }

  // Point ``stream`` at the pages that ``visit`` names, to be prefetched over ``steps`` calls
  // of a block's ``ahead`` (a key's each).
  template <typename Visit>
  void stream_pages(Visit&& visit, int64_t steps, PrefetchStream& stream) const {
    stream.reset();
    page_bytes_of(visit, [&](const char* base, int64_t bytes) { stream.add(base, bytes); });
    stream.per_step = (stream.lines + steps - 1) / std::max<int64_t>(steps, 1);
  }

  // ``rows`` rows over keys [begin, end) of ``run`` (one chunk: begin a multiple of kChunk):
  // over the pages in place; quantized, over the run decoded whole (``whole_run`` >= 0: its
  // index in ``whole``), a buffer that poses as one page of run.len tokens and one KV head,
  // or else over the chunk's keys decoded into ``sc`` (only those some row sees), a tile
  // that poses as a page of kChunk tokens and one KV head.
  void attend_keys(int64_t h, KeyRun run, int64_t whole_run, int64_t begin, int64_t end, const float* q,
                   int64_t rows, const int32_t* limit, const int32_t* first, float* m, float* l, float* acc,
                   Scratch& sc) const {
    if (quant == nullptr) {
      attend(L, h, run, begin, end, q, scale, rows, limit, first, cap2, m, l, acc, sc);
      return;
    }
#if RADIXSERVE_INT8_DOTS
    if (int8 != nullptr) {  // int8 pages, bf16 queries: integer products over the codes
      int8(L, *quant, h, run, int8_runs, whole_run, begin, end, q, scale, rows, limit, first, cap2, m, l, acc, sc);
      return;
    }
#endif
    if (whole_run >= 0) {
      const KeyRun one{WholeRuns<KV>::kOnePage, run.len, run.vpairs};
      attend(whole->layer(whole_run, h), 0, one, begin, end, q, scale, rows, limit, first, cap2, m, l, acc, sc);
      return;
    }
    KV* dk = reinterpret_cast<KV*>(sc.dk.data());
    KV* dv = reinterpret_cast<KV*>(sc.dv.data());
    if (amx_usable()) {  // the AMX tiles keep a block's values by address: the chunk decoded whole
      int64_t lo = begin, hi = end;
      if (limit != nullptr) hi = std::min<int64_t>(hi, *std::max_element(limit, limit + rows) + 1);
      if (first != nullptr) lo = std::max<int64_t>(lo, *std::min_element(first, first + rows));
      if (lo < hi) decode_keys(L, *quant, h, run, begin, lo, hi, dk, dv);
      zero_pages(sc, begin / kChunk + 1);
      forget_kept_values();  // the tile holds this chunk now, whatever it held before
      attend(Layer<KV>{dk, dv, kChunk, 1, L.d}, 0, KeyRun{sc.zero_pages.data(), run.len}, begin, end, q, scale, rows,
             limit, first, cap2, m, l, acc, sc);
      return;
    }
    // Else a block at a time, as attend_run comes to it, into kBlock rows that stay in L1
    // (a chunk's 64 KB of K and V rows did not: the stores and the loads went to L2), key i
    // at row i % kBlock; a block that starts past a multiple of kBlock (a window) wraps.
    auto decode = [&](int64_t start, int64_t n) {
      for (int64_t lo = start, hi; lo < start + n; lo = hi) {
        const int64_t base = lo - lo % kBlock;
        hi = std::min(start + n, base + kBlock);
        decode_keys(L, *quant, h, run, base, lo, hi, dk, dv);
      }
    };
    using Decode = decltype(decode);
    zero_pages(sc, (end + kBlock - 1) / kBlock);
    struct Unset {  // however attend leaves, the next call on this thread finds no fill
      Scratch& sc;
      ~Unset() { sc.fill = {}, sc.fp8 = nullptr; }
    } unset{sc};
    sc.fill = {[](const void* ctx, int64_t start, int64_t n) { (*static_cast<const Decode*>(ctx))(start, n); },
               &decode};
#if RADIXSERVE_FP8_BYTES
    // fp8 codes at scale 1 for bf16 rows: the narrow blocks read them in place (paged_attention_fp8.h).
    std::optional<Fp8Narrow> codes;
    if (std::is_same_v<KV, c10::BFloat16> && is_fp8(quant->codes) && quant->k_scale[h] == 1.0f &&
        quant->v_scale[h] == 1.0f && L.d % 64 == 0) {
      codes = Fp8Narrow{{quant->k, quant->v, L.page_size, L.kv_heads, L.d}, run.pages, h, &Fp8Bytes::of(quant->codes)};
      sc.fp8 = &*codes;
    }
#endif
    attend(Layer<KV>{dk, dv, kBlock, 1, L.d}, 0, KeyRun{sc.zero_pages.data(), run.len}, begin, end, q, scale, rows,
           limit, first, cap2, m, l, acc, sc);
  }

  // At least ``n`` page ids of zero in ``sc.zero_pages``: a tile posing as the pages of a run.
  static void zero_pages(Scratch& sc, int64_t n) {
    if (static_cast<int64_t>(sc.zero_pages.size()) < n) sc.zero_pages.resize(n, 0);
  }

  // Chunk ``c`` of the item's keys for its rows (in ``sc`` from load_rows), from nothing, into ``s``.
  void chunk_state(const Item& item, int64_t c, State s, Scratch& sc) const {
    const int64_t d = L.d, h = item.head, rows = item.row_end - item.row_begin;
    std::fill(s.m, s.m + rows, kNoMax);
    std::fill(s.l, s.l + rows, 0.0f);
    std::fill(s.acc, s.acc + rows * d, 0.0f);
    const int64_t shared = shared_len(item), shared_chunks = (shared + kChunk - 1) / kChunk;
    if (c < shared_chunks) {  // the group's shared pages: no mask
      const KeyRun run{P.shared_pages + P.shared_start[item.group], shared, paired(shared_pairs, item.group, h)};
      const int64_t w = shared_whole != nullptr ? shared_whole[item.group] : -1;
      attend_keys(h, run, w, c * kChunk, std::min(shared, (c + 1) * kChunk), sc.q.data(), rows, nullptr, nullptr,
                  s.m, s.l, s.acc, sc);
      return;
    }
    const int64_t begin = (c - shared_chunks) * kChunk;
    auto [mi, skip] = first_member(item);
    for (int64_t r = 0; r < rows; ++mi) {  // each member's rows over its own pages, causally
      const int64_t seg = std::min(rows - r, P.new_len[mi] * grp - skip);
      if (begin < P.own_len[mi]) {
        const KeyRun run{P.own_pages + P.own_start[mi], P.own_len[mi], paired(own_pairs, mi, h)};
        const int64_t w = own_whole != nullptr ? own_whole[mi] : -1;
        attend_keys(h, run, w, begin, std::min(P.own_len[mi], begin + kChunk), sc.q.data() + r * d, seg,
                    sc.limit.data() + r, window > 0 ? sc.first.data() + r : nullptr, s.m + r, s.l + r, s.acc + r * d,
                    sc);
      }
      r += seg;
      skip = 0;
    }
  }

  // out = acc / l for the item's rows, the head's sink in l where there are sinks (rotated
  // back, from rotated pages).
  void write_out(const Item& item, State s) const {
    const int64_t d = L.d, h = item.head, rows = item.row_end - item.row_begin;
    auto [mi, skip] = first_member(item);
    float row[kMaxHeadDim];
    for (int64_t r = 0; r < rows; ++r, ++skip) {
      if (skip == P.new_len[mi] * grp) skip = 0, ++mi;
      const int64_t t = skip / grp, head = h * grp + skip % grp;
      Q* dst = od + ((P.q_start[mi] + t) * hq + head) * d;
      const float inv = 1.0f / (sinks2 == nullptr ? s.l[r] : s.l[r] + std::exp2(sinks2[head] - s.m[r]));
      const float* ar = s.acc + r * d;
      for (int64_t j = 0; j < d; ++j) row[j] = ar[j] * inv;
      if (rotated()) hadamard_rotate(row, d);
      for (int64_t j = 0; j < d; ++j) dst[j] = from_float<Q>(row[j]);
    }
  }

  // The whole item on this thread: its chunks one after the other, each merged as it comes.
  void run_item(const Item& item, Scratch& sc) const {
    load_rows(item, sc);
    const State s{sc.m.data(), sc.l.data(), sc.acc.data()}, t{sc.m2.data(), sc.l2.data(), sc.acc2.data()};
    const int64_t n = chunks(item), rows = item.row_end - item.row_begin;
    chunk_state(item, 0, s, sc);  // = merging it into nothing
    for (int64_t c = 1; c < n; ++c) {
      chunk_state(item, c, t, sc);
      merge_state(s, t, rows, L.d);
    }
    write_out(item, s);
  }
};

// Rows of one KV head that read a quantized run, from which it is decoded whole for the call
// (WholeRuns) rather than in the tile for each block of kRowBlock rows: two blocks, so
// that a run decoded whole saves at least one decoding of each key. On the 2-core Xeon VM
// (SmolLM2's shape, bf16 queries, one extend over 6,000 cached keys, int8 and fp8 pages),
// 33 and 48 rows took less time decoded whole, 18 and 24 rows about the same or more; over
// 500 keys 33 and 48 rows took about the same either way.
constexpr int64_t kWholeRunRows = 2 * kRowBlock;

// The plan's runs that kWholeRunRows rows or more of one KV head read, taken into ``whole``
// (WholeRuns: quantized runs decoded whole; ValuePairs: bf16 values paired whole; up to its
// bound); their indices into ``shared_whole`` (per group) and ``own_whole`` (per member), -1
// for the others. None with a window: its rows read only the last ``window`` keys each, and
// a long run taken whole would be mostly keys no row sees (and its blocks may start at odd keys).
template <typename Runs>
void plan_whole_runs(const Plan& P, int64_t groups, int64_t grp, int64_t page_size, int64_t window, Runs& whole,
                     std::vector<int64_t>& shared_whole, std::vector<int64_t>& own_whole) {
  shared_whole.assign(groups, -1);
  own_whole.assign(P.group_start[groups], -1);
  if (window > 0) return;
  for (int64_t g = 0; g < groups; ++g) {
    int64_t rows = 0;
    for (int64_t mi = P.group_start[g]; mi < P.group_start[g + 1]; ++mi) {
      rows += P.new_len[mi] * grp;
      if (P.new_len[mi] * grp >= kWholeRunRows) own_whole[mi] = whole.add({P.own_pages + P.own_start[mi], P.own_len[mi]});
    }
    const int64_t shared = (P.shared_start[g + 1] - P.shared_start[g]) * page_size;
    if (shared > 0 && rows >= kWholeRunRows) shared_whole[g] = whole.add({P.shared_pages + P.shared_start[g], shared});
  }
}

// The runs one call takes whole (plan_whole_runs), and what reads them: quantized runs decoded
// whole, int8 runs made ready for the integer path, bf16 values paired once; each run's index
// per group (its shared run) and per member (its own run), -1 for a run taken block by block.
template <typename Q, typename KV>
struct CallRuns {
  WholeRuns<KV> whole;
  Int8Runs int8_runs;
  ValuePairs pairs;
  std::vector<int64_t> shared_whole, own_whole, shared_pairs, own_pairs;
  // Not where AMX runs: its bf16 tiles take a prefill's rows over the decoded codes at several
  // times the rate of AVX-512's integer products (unmeasured on int8 pages: no AMX machine).
  const Int8AttendFn<KV> int8;

  CallRuns(const Layer<KV>& L, const Plan& P, int64_t groups, int64_t grp, int64_t window, const QuantPages* quant)
      : whole(L.kv_heads, L.d),
        int8_runs(L.kv_heads, L.d),
        pairs(L.kv_heads, L.d),
        int8(amx_usable() ? nullptr : int8_attend_fn<Q, KV>(quant, L.d)) {
    // Runs that many rows read, decoded whole (or, for the integer path, made ready whole).
    if (int8 != nullptr) {
      plan_whole_runs(P, groups, grp, L.page_size, window, int8_runs, shared_whole, own_whole);
    } else if (quant != nullptr) {
      plan_whole_runs(P, groups, grp, L.page_size, window, whole, shared_whole, own_whole);
    }
    // bf16 values paired once for the call where the rows score pairs on AVX-512 (the AMX
    // tiles keep value tiles of their own): the pool's runs, or the quantized runs decoded
    // whole (paired as each chunk is decoded; a run's index the same in both).
    if (pair_scores_for<Q, KV>(L.d) && !amx_usable()) {
      if (quant == nullptr) plan_whole_runs(P, groups, grp, L.page_size, window, pairs, shared_pairs, own_pairs);
      for (int64_t i = 0; i < whole.size(); ++i) TORCH_CHECK(pairs.add(whole.run(i)) == i, "pairs of a whole run");
      if (!whole.empty()) shared_pairs = shared_whole, own_pairs = own_whole;
    }
    if (!whole.empty()) whole.prepare();
    if (!pairs.empty()) pairs.prepare();
    if (!int8_runs.empty()) int8_runs.prepare();
  }

  bool any() const { return !whole.empty() || !pairs.empty() || !int8_runs.empty(); }

  // The call's kernel, reading these runs where it was given them.
  Kernel<Q, KV> kernel(const Layer<KV>& L, const Plan& P, const at::Tensor& q, at::Tensor& out, int64_t grp,
                       double sm_scale, int64_t window, double softcap, const QuantPages* quant,
                       const float* sinks2) const {
    const bool indexed = !whole.empty() || !int8_runs.empty(), paired = !pairs.empty();
    return Kernel<Q, KV>{L,
                         P,
                         q.data_ptr<Q>(),
                         q.stride(0),
                         q.stride(1),
                         out.data_ptr<Q>(),
                         q.size(1),
                         grp,
                         static_cast<float>(sm_scale) * kLog2e,
                         attend_fn<Q, KV>(L.d),
                         window,
                         static_cast<float>(softcap) * kLog2e,
                         quant,
                         whole.empty() ? nullptr : &whole,
                         indexed ? shared_whole.data() : nullptr,
                         indexed ? own_whole.data() : nullptr,
                         paired ? &pairs : nullptr,
                         paired ? shared_pairs.data() : nullptr,
                         paired ? own_pairs.data() : nullptr,
                         int8,
                         int8_runs.empty() ? nullptr : &int8_runs,
                         sinks2};
  }

  // Thread ``t`` of a team of ``nt`` decodes (pairs, makes ready) its share of the runs, then
  // waits for the others.
  void take_share(const Layer<KV>& L, const QuantPages* quant, int64_t t, int64_t nt) {
    if (!any()) return;
    if (!int8_runs.empty()) {
      int8_runs.ready_share(L, *quant, t, nt);
    } else if (!whole.empty()) {
      whole.decode_share(L, *quant, t, nt, [&](int64_t i, int64_t h, int64_t lo) {
        if (!pairs.empty()) pairs.pair_keys(whole.layer(i, h), WholeRuns<KV>::kOnePage, 0, i, h, lo);
      });
    } else {
      pairs.pair_share(L, t, nt);
    }
    if (nt > 1) {
#pragma omp barrier
    }
  }
};

// A call's items (a group's rows of one KV head, kRowBlock at a time); per group, whether one
// item per KV head holds all its rows (a decode row, a few): each page is then read once, by
// arithmetic too light to hide its misses (run_whole_items, run_chunk_tasks); and the call's
// work in lane-multiply-adds, roughly (row vectors x keys x d).
struct Items {
  std::vector<Item> items;
  std::vector<char> one_block;
  int64_t work = 0;
};

template <typename KV>
Items plan_items(const Plan& P, const Layer<KV>& L, int64_t groups, int64_t grp) {
  Items I;
  I.one_block.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    int64_t rows = 0, keys = 0;
    for (int64_t i = P.group_start[g]; i < P.group_start[g + 1]; ++i) {
      rows += P.new_len[i] * grp;
      keys = std::max(keys, P.own_len[i]);
    }
    I.one_block[g] = rows <= kRowBlock;
    keys += (P.shared_start[g + 1] - P.shared_start[g]) * L.page_size;
    for (int64_t h = 0; h < L.kv_heads; ++h) {
      for (int64_t b = 0; b < rows; b += kRowBlock) I.items.push_back({g, h, b, std::min(rows, b + kRowBlock)});
    }
    I.work += L.kv_heads * ((rows + kLanes - 1) / kLanes) * kLanes * keys * L.d;
  }
  return I;
}

// Enough items to keep every thread busy: each runs whole items, a run of them in order (a
// group's KV heads, then the next group's: their pages are the same) and then what is left of
// the others' runs from their ends, so that items of different costs (causal rows late in a
// prompt see more keys) still end together. Before a group's first item of its run, a thread
// reads the group's pages, when one item per KV head holds its rows and the pages fit in half
// its L2 (Kernel::read_first): decode rows of 4-16 sequences at 300-600 keys, 26-35 % less
// time with bf16 pages from memory, 8-19 % with float32 (2-core Xeon VM,
// bench_decode_attention.py --batch); bigger groups (prefill chunks, many rows over a shared
// prefix) read each page for several items, with more arithmetic per key.
template <typename Q, typename KV>
void run_whole_items(const Kernel<Q, KV>& K, const Items& I, CallRuns<Q, KV>& runs, int64_t threads) {
  const std::vector<Item>& items = I.items;
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::unique_ptr<std::atomic<bool>[]> claimed(new std::atomic<bool>[n_items]());
#pragma omp parallel num_threads(threads)
  {
    Scratch& sc = Scratch::local(K.L.d);
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    runs.take_share(K.L, K.quant, t, nt);
    int64_t touched = -1;
    for_runs(n_items, t, nt, [&](int64_t i, bool own) {
      if (claimed[i].exchange(true, std::memory_order_relaxed)) return;
      const int64_t g = items[i].group;
      if (own && g != touched && I.one_block[g]) {
        touched = g;
        K.read_first([&](auto&& f) { K.group_pages(g, f); });
      }
      K.run_item(items[i], sc);
    });
    release_tiles(sc);
  }
}

// Few items over many keys (a decode step of a few sequences): every chunk of every item is a
// task of its own, its softmax state kept apart; then each item merges its chunks in order.
// The tasks run chunk by chunk, every KV head's task of a chunk after the other: those read
// the same pages (a token's heads lie side by side), so the hardware prefetcher, which streams
// whole pages, brings the next heads' rows in while the first head's are read. Each thread
// runs a run of that order (whole chunks' pages), then what is left of the others' (for_runs).
// Against one task at a time to whichever thread asked, head by head (OpenMP's dynamic
// schedule), on a 2-core Xeon VM: 4-11 % less time at 600-2000 keys with the pages coming
// from memory, up to 18 % from the caches (benchmarks/bench_decode_attention.py; same bits).
template <typename Q, typename KV>
class ChunkTasks {
 public:
  struct Task {
    int64_t item, chunk;
    int64_t offset;  // of its state in ``states_``: m [rows], l [rows], acc [rows, d]
  };

  ChunkTasks(const Kernel<Q, KV>& K, const std::vector<Item>& items) : K_(K), items_(items) {
    first_task_.assign(items.size() + 1, 0);
    int64_t floats = 0;
    for (size_t it = 0; it < items.size(); ++it) {
      const int64_t n = K.chunks(items[it]);
      for (int64_t c = 0; c < n; ++c, floats += rows(it) * (K.L.d + 2)) {
        tasks_.push_back({static_cast<int64_t>(it), c, floats});
      }
      first_task_[it + 1] = static_cast<int64_t>(tasks_.size());
    }
    // Every task writes its whole state before any merge reads it: the buffer is kept across
    // calls on the calling thread and never zeroed. A fresh zeroed vector per call was ~140
    // KB per layer at 7,500 keys (3 KV heads x 59 chunks x 3 rows x 66 floats), past glibc's
    // default mmap threshold (128 KiB) from ~7,000 keys of SmolLM2's shape on. (A pointer,
    // not the thread_local itself, goes to the team: in another thread the name would be
    // that thread's own buffer.)
    thread_local std::vector<float> states_buf;
    if (static_cast<int64_t>(states_buf.size()) < floats) states_buf.resize(floats);
    states_ = states_buf.data();
    // The order the threads take them in: chunk 0 of every item, then chunk 1, ...
    order_.reserve(tasks_.size());
    for (int64_t c = 0; order_.size() < tasks_.size(); ++c) {
      for (size_t it = 0; it < items.size(); ++it) {
        if (first_task_[it] + c < first_task_[it + 1]) order_.push_back(first_task_[it] + c);
      }
    }
  }

  int64_t size() const { return static_cast<int64_t>(tasks_.size()); }
  // The ``j``-th task in the threads' order, and its item.
  const Task& task(int64_t j) const { return tasks_[order_[j]]; }
  const Item& item(int64_t j) const { return items_[task(j).item]; }
  // Whether the ``a``-th and ``b``-th tasks read the same pages (one chunk, other KV heads).
  bool same_chunk(int64_t a, int64_t b) const {
    return item(a).group == item(b).group && task(a).chunk == task(b).chunk;
  }

  // The ``j``-th task's state, computed.
  void run(int64_t j, Scratch& sc) const {
    K_.load_rows(item(j), sc);
    K_.chunk_state(item(j), task(j).chunk, state_of(task(j)), sc);
  }

  // Item ``it``'s chunks merged in order, and written out.
  void finish_item(size_t it) const {
    const State s = state_of(tasks_[first_task_[it]]);
    for (int64_t i = first_task_[it] + 1; i < first_task_[it + 1]; ++i) {
      merge_state(s, state_of(tasks_[i]), rows(it), K_.L.d);
    }
    K_.write_out(items_[it], s);
  }

 private:
  int64_t rows(size_t it) const { return items_[it].row_end - items_[it].row_begin; }
  State state_of(const Task& task) const {
    float* base = states_ + task.offset;
    const int64_t n = rows(task.item);
    return State{base, base + n, base + 2 * n};
  }

  const Kernel<Q, KV>& K_;
  const std::vector<Item>& items_;
  std::vector<int64_t> first_task_;  // item it's tasks: [first_task_[it], first_task_[it + 1])
  std::vector<Task> tasks_;
  std::vector<int64_t> order_;  // indices into tasks_
  float* states_ = nullptr;
};

// Thread ``t``'s pass over the chunk tasks (for_runs), each claimed once. First it reads the
// pages of its run's chunks (Kernel::read_first): a decode step's KV, evicted by the weights
// streamed since, was waited on. bf16 pages, 256-2000 keys, 19-25 % less time; float32 pages
// (twice the bytes for the same arithmetic) the same time within 3 % (2-core Xeon VM,
// bench_decode_attention.py). Too many to stay in L2 until their turn (a long context): the
// pages of the thread's next chunk, every KV head's, are prefetched from inside the current
// chunk's blocks (stream_ahead), so that its tasks find them in L2 and the reads overlap the
// arithmetic (against a blocking pass over each chunk's pages before its tasks: at 7,500 keys
// ~0.6x the time per layer with the pages from memory, on the 2-core AMD VM,
// bench_decode_attention.py); a chunk not streamed (the run's first, one taken from another
// thread's run) is read in a pass as the thread comes to its first task.
template <typename Q, typename KV>
class ChunkPass {
 public:
  ChunkPass(const Kernel<Q, KV>& K, const ChunkTasks<Q, KV>& T, std::atomic<bool>* claimed, int64_t t, int64_t nt,
            Scratch& sc)
      : K_(K), T_(T), claimed_(claimed), t_(t), nt_(nt), own_end_(T.size() * (t + 1) / nt), sc_(sc) {}

  void run() {
    const bool read_all = read_own_run();
    for_runs(T_.size(), t_, nt_, [&](int64_t j, bool own) {
      const Task& task = T_.task(j);
      const Item& item = T_.item(j);
      if (!read_all && !claimed_[j].load(std::memory_order_relaxed) &&
          (item.group != read_group_ || task.chunk != read_chunk_)) {
        read_group_ = item.group, read_chunk_ = task.chunk;
        if (!own || j >= streamed_to_) K_.read_pages([&](auto&& f) { K_.chunk_pages(item, task.chunk, f); });
        if (own) stream_ahead(j);
        else sc_.streaming = false;
      }
      if (!claimed_[j].exchange(true, std::memory_order_relaxed)) T_.run(j, sc_);
    });
    sc_.streaming = false;
    sc_.stream.reset();  // nothing of this call's pages is prefetched by a later one
  }

 private:
  using Task = typename ChunkTasks<Q, KV>::Task;

  // Read the pages of the own run's chunks ahead, where they fit (Kernel::read_first).
  bool read_own_run() const {
    return K_.read_first([&](auto&& f) {
      for (int64_t j = T_.size() * t_ / nt_; j < own_end_; ++j) {
        if (j > T_.size() * t_ / nt_ && T_.same_chunk(j, j - 1)) continue;  // its other KV heads
        K_.chunk_pages(T_.item(j), T_.task(j).chunk, f);
      }
    });
  }

  // The first task of the chunk after task j's, in the own run.
  int64_t next_chunk(int64_t j) const {
    while (j + 1 < own_end_ && T_.same_chunk(j + 1, j)) ++j;
    return j + 1;
  }

  // Stream the own run's next chunk over the keys that task j's chunk's tasks (one per KV
  // head) score, what is left of the last stream prefetched first. Streaming two chunks ahead
  // measured the same.
  void stream_ahead(int64_t j) {
    sc_.stream.finish();
    const int64_t next = next_chunk(j);
    sc_.streaming = next < own_end_;
    if (!sc_.streaming) return;
    K_.stream_pages([&](auto&& f) { K_.chunk_pages(T_.item(next), T_.task(next).chunk, f); }, (next - j) * kChunk,
                    sc_.stream);
    streamed_to_ = next_chunk(next);
  }

  const Kernel<Q, KV>& K_;
  const ChunkTasks<Q, KV>& T_;
  std::atomic<bool>* claimed_;
  const int64_t t_, nt_, own_end_;
  Scratch& sc_;
  int64_t read_group_ = -1, read_chunk_ = -1;  // the chunk whose pages were read last
  int64_t streamed_to_ = 0;                      // the own run's tasks before this one have been streamed
};

template <typename Q, typename KV>
void run_chunk_tasks(const Kernel<Q, KV>& K, const std::vector<Item>& items, CallRuns<Q, KV>& runs,
                     int64_t max_threads) {
  const ChunkTasks<Q, KV> T(K, items);
  std::unique_ptr<std::atomic<bool>[]> claimed(new std::atomic<bool>[T.size()]());
  const int64_t threads = std::min<int64_t>(max_threads, T.size());
#pragma omp parallel num_threads(threads)
  {
    Scratch& sc = Scratch::local(K.L.d);
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    runs.take_share(K.L, K.quant, t, nt);
    ChunkPass<Q, KV>(K, T, claimed.get(), t, nt, sc).run();
    release_tiles(sc);
#pragma omp barrier
#pragma omp for schedule(static, 1)
    for (size_t it = 0; it < items.size(); ++it) T.finish_item(it);
  }
}

template <typename Q, typename KV>
void run_kernel(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, at::Tensor& out,
                const Plan& P, int64_t groups, double sm_scale, int64_t window, double softcap,
                const float* sinks2, const QuantPages* quant = nullptr) {
  const int64_t d = q.size(2);
  // Quantized pages: only their geometry here (KV is the dtype they are decoded to).
  const KV* kp = quant != nullptr ? nullptr : k_pages.data_ptr<KV>();
  const KV* vp = quant != nullptr ? nullptr : v_pages.data_ptr<KV>();
  const Layer<KV> L{kp, vp, k_pages.size(1), k_pages.size(2), d};
  const int64_t grp = q.size(1) / L.kv_heads;
  CallRuns<Q, KV> runs(L, P, groups, grp, window, quant);
  const Kernel<Q, KV> K = runs.kernel(L, P, q, out, grp, sm_scale, window, softcap, quant, sinks2);
  const Items I = plan_items(P, L, groups, grp);
  const int64_t max_threads = at::get_num_threads();
  if (max_threads <= 1 || I.work < kSerialWork) {
    runs.take_share(L, quant, 0, 1);
    Scratch& sc = Scratch::local(d);
    for (const Item& item : I.items) K.run_item(item, sc);
    release_tiles(sc);
  } else if (static_cast<int64_t>(I.items.size()) >= 4 * max_threads) {
    run_whole_items(K, I, runs, max_threads);
  } else {
    run_chunk_tasks(K, I.items, runs, max_threads);
  }
}

// The sinks of ``q``'s heads scaled into the kernel's log2 domain (empty: none).
std::vector<float> sinks_log2(const at::Tensor& q, const std::optional<at::Tensor>& sinks) {
  if (!sinks.has_value()) return {};
  const at::Tensor& t = *sinks;
  TORCH_CHECK(t.dim() == 1 && t.size(0) == q.size(1) && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.device().is_cpu(),
              "sinks must be a contiguous float32 CPU tensor with one value per query head");
  std::vector<float> out(t.size(0));
  const float* src = t.data_ptr<float>();
  for (int64_t h = 0; h < t.size(0); ++h) out[h] = src[h] * kLog2e;
  return out;
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous 1-D int64 CPU tensor");
}

// The checks every op makes of its arguments (see paged_attention below), and its plan.
Plan checked_plan(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& out,
                  const at::Tensor& q_start, const at::Tensor& new_len, const at::Tensor& group_start,
                  const at::Tensor& shared_pages, const at::Tensor& shared_start, const at::Tensor& own_pages,
                  const at::Tensor& own_start, const at::Tensor& own_len, int64_t window, double softcap,
                  bool packed_int4 = false) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(window == 0 || shared_pages.size(0) == 0, "a plan with a window shares no pages");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.device().is_cpu(),
              "q must be a [T, Hq, D] CPU tensor with contiguous rows of D");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "out must be a contiguous tensor like q");
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.is_contiguous() && v_pages.sizes() == k_pages.sizes() &&
                  v_pages.scalar_type() == k_pages.scalar_type() && v_pages.is_contiguous(),
              "k_pages and v_pages must be contiguous [num_pages, page_size, Hkv, D] tensors of one dtype");
  TORCH_CHECK(k_pages.size(3) * (packed_int4 ? 2 : 1) == q.size(2), "head_dim of q and the pages differ",
              packed_int4 ? " (int4 pages hold head_dim / 2 bytes a row)" : "");
  TORCH_CHECK((attend_fn<float, float>(q.size(2)) != nullptr), "head_dim must be one of 16, 32, 64, 80, 96, 128, 256, got ",
              q.size(2));
  TORCH_CHECK(q.size(1) % k_pages.size(2) == 0, "query heads must be a multiple of KV heads");
  for (auto [t, name] : {std::pair{&q_start, "q_start"}, {&new_len, "new_len"}, {&group_start, "group_start"},
                         {&shared_pages, "shared_pages"}, {&shared_start, "shared_start"},
                         {&own_pages, "own_pages"}, {&own_start, "own_start"}, {&own_len, "own_len"}}) {
    check_index(*t, name);
  }
  const int64_t members = q_start.size(0);
  TORCH_CHECK(shared_start.size(0) == group_start.size(0), "shared_start needs one entry per group, plus one");
  TORCH_CHECK(new_len.size(0) == members && own_start.size(0) == members + 1 && own_len.size(0) == members,
              "new_len/own_start/own_len need one entry per member (plus one)");
  const Plan P{q_start.data_ptr<int64_t>(),      new_len.data_ptr<int64_t>(),   group_start.data_ptr<int64_t>(),
               shared_pages.data_ptr<int64_t>(), shared_start.data_ptr<int64_t>(), own_pages.data_ptr<int64_t>(),
               own_start.data_ptr<int64_t>(),    own_len.data_ptr<int64_t>()};
  TORCH_CHECK(group_start.size(0) >= 1 && P.group_start[0] == 0 && P.group_start[group_start.size(0) - 1] == members,
              "group_start must run from 0 to the number of members");
  // The start arrays index the page lists: each must be non-decreasing and stay inside its list.
  auto check_starts = [](const int64_t* starts, int64_t n, int64_t end, const char* name) {
    TORCH_CHECK(starts[0] >= 0 && starts[n - 1] <= end, name, " must stay within [0, ", end, "]");
    for (int64_t i = 1; i < n; ++i) TORCH_CHECK(starts[i - 1] <= starts[i], name, " must be non-decreasing");
  };
  check_starts(P.group_start, group_start.size(0), members, "group_start");
  check_starts(P.shared_start, shared_start.size(0), shared_pages.size(0), "shared_start");
  check_starts(P.own_start, own_start.size(0), own_pages.size(0), "own_start");
  for (int64_t i = 0; i < members; ++i) {
    TORCH_CHECK(P.new_len[i] >= 1 && P.new_len[i] <= P.own_len[i] &&
                    P.own_len[i] <= (P.own_start[i + 1] - P.own_start[i]) * k_pages.size(1) &&
                    P.q_start[i] >= 0 && P.q_start[i] + P.new_len[i] <= q.size(0),
                "member ", i, ": its new rows must lie in q and among its own keys, which its pages must hold");
  }
  const int64_t num_pages = k_pages.size(0);
  for (const at::Tensor* pages : {&shared_pages, &own_pages}) {
    const int64_t* ids = pages->data_ptr<int64_t>();
    for (int64_t i = 0; i < pages->size(0); ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < num_pages, "page id ", ids[i], " out of range [0, ", num_pages, ")");
    }
  }
  return P;
}

// The new rows' flat slots, checked with the rows (see paged_attention), or null: none given.
const int64_t* checked_slots(const at::Tensor& q, const at::Tensor& k_pages, const std::optional<at::Tensor>& k_new,
                             const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(k_new.has_value() == v_new.has_value() && k_new.has_value() == slots.has_value(),
              "k_new, v_new and slots go together");
  if (!slots.has_value()) return nullptr;
  check_index(*slots, "slots");
  const int64_t n = slots->size(0);
  for (const at::Tensor* t : {&*k_new, &*v_new}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == k_pages.size(2) && t->size(2) == q.size(2) &&
                    t->stride(2) == 1 && t->scalar_type() == q.scalar_type() && t->device().is_cpu(),
                "k_new and v_new must be [len(slots), Hkv, D] CPU tensors of q's dtype with contiguous rows of D");
  }
  const int64_t* ids = slots->data_ptr<int64_t>();
  const int64_t num_slots = k_pages.size(0) * k_pages.size(1);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_slots, "slot ", ids[i], " out of range [0, ", num_slots, ")");
  }
  return ids;
}

// Attention of every planned row of q into out. Member i (a sequence) has new_len[i] new
// tokens at rows q_start[i].. of q; its group g is the one with group_start[g] <= i <
// group_start[g+1], whose members first read shared_pages[shared_start[g]:shared_start[g+1]];
// then member i reads the first own_len[i] tokens of own_pages[own_start[i]:own_start[i+1]],
// whose last new_len[i] keys are its new tokens: stored in the pages before this call, or
// by it, from k_new/v_new ([T', Hkv, D]) at flat slots ``slots`` ([T'] int64), when given.
// ``window`` > 0: each row sees only the last ``window`` keys up to its own (a sliding
// window; the plan then shares no pages, and may start a member's own pages at the first
// page its first row's window reaches). ``softcap`` > 0: scores become
// softcap * tanh(score / softcap) before the softmax (Gemma 2). ``sinks`` ([Hq] float32):
// each query head's sink logit joins every row's softmax denominator (gpt-oss).
void paged_attention(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, at::Tensor out,
                     const at::Tensor& q_start, const at::Tensor& new_len, const at::Tensor& group_start,
                     const at::Tensor& shared_pages, const at::Tensor& shared_start, const at::Tensor& own_pages,
                     const at::Tensor& own_start, const at::Tensor& own_len, double sm_scale,
                     const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                     const std::optional<at::Tensor>& slots, int64_t window, double softcap,
                     const std::optional<at::Tensor>& sinks) {
  const std::vector<float> sinks_scaled = sinks_log2(q, sinks);
  const float* sinks2 = sinks_scaled.empty() ? nullptr : sinks_scaled.data();
  const Plan P = checked_plan(q, k_pages, v_pages, out, q_start, new_len, group_start, shared_pages, shared_start,
                              own_pages, own_start, own_len, window, softcap);
  const int64_t groups = group_start.size(0) - 1;
  if (const int64_t* ids = checked_slots(q, k_pages, k_new, v_new, slots)) store_kv(*k_new, *v_new, ids, k_pages, v_pages);

#define RADIX_DISPATCH_KV(QT)                                                                              \
  switch (k_pages.scalar_type()) {                                                                         \
    case at::kFloat: return run_kernel<QT, float>(q, k_pages, v_pages, out, P, groups, sm_scale, window, softcap, sinks2); \
    case at::kBFloat16:                                                                                            \
      return run_kernel<QT, c10::BFloat16>(q, k_pages, v_pages, out, P, groups, sm_scale, window, softcap, sinks2);       \
    case at::kHalf: return run_kernel<QT, c10::Half>(q, k_pages, v_pages, out, P, groups, sm_scale, window, softcap, sinks2); \
    default: TORCH_CHECK(false, "unsupported KV dtype ", k_pages.scalar_type());                          \
  }
  switch (q.scalar_type()) {
    case at::kFloat: RADIX_DISPATCH_KV(float)
    case at::kBFloat16: RADIX_DISPATCH_KV(c10::BFloat16)
    case at::kHalf: RADIX_DISPATCH_KV(c10::Half)
    default: TORCH_CHECK(false, "unsupported query dtype ", q.scalar_type());
  }
#undef RADIX_DISPATCH_KV
}

// paged_attention over quantized pages (paged_attention_quant.h), their new rows stored
// first from k_new/v_new at ``slots`` when given (quantized as store_kv_quant says): int8
// codes (kChar) or int4 codes two a byte (kByte, [.., Hkv, D / 2], Hadamard-rotated rows, D a
// power of two) with ``k_scale``/``v_scale`` per token and KV head ([num_pages, page_size,
// Hkv] float32), or fp8 e4m3 / e5m2 codes with one scale per KV head ([Hkv] float32). Each
// chunk of keys is decoded to q's dtype and attended as unquantized pages of that dtype are
// (int4: in the rotated basis, QuantPages).
void paged_attention_quant(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, at::Tensor out,
                           const at::Tensor& q_start, const at::Tensor& new_len, const at::Tensor& group_start,
                           const at::Tensor& shared_pages, const at::Tensor& shared_start,
                           const at::Tensor& own_pages, const at::Tensor& own_start, const at::Tensor& own_len,
                           double sm_scale, const at::Tensor& k_scale, const at::Tensor& v_scale,
                           const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                           const std::optional<at::Tensor>& slots, int64_t window, double softcap,
                           const std::optional<at::Tensor>& sinks) {
  const std::vector<float> sinks_scaled = sinks_log2(q, sinks);
  const float* sinks2 = sinks_scaled.empty() ? nullptr : sinks_scaled.data();
  Codes codes;
  switch (k_pages.scalar_type()) {
    case at::kChar: codes = Codes::kInt8; break;
    case at::kByte: codes = Codes::kInt4; break;
    case at::kFloat8_e4m3fn: codes = Codes::kFp8E4M3; break;
    case at::kFloat8_e5m2: codes = Codes::kFp8E5M2; break;
    default:
      TORCH_CHECK(false, "quantized pages must be int8, uint8 (int4), float8_e4m3fn or float8_e5m2, not ",
                  k_pages.scalar_type());
  }
  const Plan P = checked_plan(q, k_pages, v_pages, out, q_start, new_len, group_start, shared_pages, shared_start,
                              own_pages, own_start, own_len, window, softcap, codes == Codes::kInt4);
  TORCH_CHECK(codes != Codes::kInt4 || (q.size(2) & (q.size(2) - 1)) == 0,
              "int4 pages need a power-of-two head_dim (their rows are Hadamard-rotated), got ", q.size(2));
  const auto scale_shape = token_scaled(codes) ? k_pages.sizes().slice(0, 3) : k_pages.sizes().slice(2, 1);
  for (const at::Tensor* t : {&k_scale, &v_scale}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu() && t->sizes() == scale_shape,
                "scales must be contiguous float32 CPU tensors of shape ", scale_shape);
  }
  if (const int64_t* ids = checked_slots(q, k_pages, k_new, v_new, slots)) {
    store_kv_quant(*k_new, *v_new, ids, k_pages, v_pages, k_scale, v_scale);
  }
  const QuantPages quant{static_cast<const uint8_t*>(k_pages.data_ptr()), static_cast<const uint8_t*>(v_pages.data_ptr()),
                         k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), codes};
  const int64_t groups = group_start.size(0) - 1;
  switch (q.scalar_type()) {
    case at::kFloat: return run_kernel<float, float>(q, k_pages, v_pages, out, P, groups, sm_scale, window, softcap, sinks2, &quant);
    case at::kBFloat16:
      return run_kernel<c10::BFloat16, c10::BFloat16>(q, k_pages, v_pages, out, P, groups, sm_scale, window, softcap,
                                                      sinks2, &quant);
    case at::kHalf:
      return run_kernel<c10::Half, c10::Half>(q, k_pages, v_pages, out, P, groups, sm_scale, window, softcap, sinks2, &quant);
    default: TORCH_CHECK(false, "unsupported query dtype ", q.scalar_type());
  }
}

// Whether bf16 queries over int8 pages of head size ``head_dim`` take the integer path here
// (paged_attention_int8.h): built with AVX-512 VNNI and BF16, and no AMX to run (else the
// codes are decoded to bf16, paged_attention_quant.h).
bool int8_attention_in_integers(int64_t head_dim) {
  const QuantPages int8{nullptr, nullptr, nullptr, nullptr, Codes::kInt8};
  return !amx_usable() && int8_dots_for<c10::BFloat16>(&int8, head_dim);
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("int8_attention_in_integers(int head_dim) -> bool", &int8_attention_in_integers);
  m.def(
      "paged_attention(Tensor q, Tensor(b!) k_pages, Tensor(c!) v_pages, Tensor(a!) out, Tensor q_start, Tensor new_len, "
      "Tensor group_start, Tensor shared_pages, Tensor shared_start, Tensor own_pages, Tensor own_start, "
      "Tensor own_len, float sm_scale, Tensor? k_new=None, Tensor? v_new=None, Tensor? slots=None, int window=0, "
      "float softcap=0.0, Tensor? sinks=None) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def(
      "paged_attention_quant(Tensor q, Tensor(b!) k_pages, Tensor(c!) v_pages, Tensor(a!) out, Tensor q_start, "
      "Tensor new_len, Tensor group_start, Tensor shared_pages, Tensor shared_start, Tensor own_pages, "
      "Tensor own_start, Tensor own_len, float sm_scale, Tensor(d!) k_scale, Tensor(e!) v_scale, Tensor? k_new=None, "
      "Tensor? v_new=None, Tensor? slots=None, int window=0, float softcap=0.0, Tensor? sinks=None) -> ()");
  m.impl("paged_attention_quant", c10::DispatchKey::CPU, &paged_attention_quant);
}
