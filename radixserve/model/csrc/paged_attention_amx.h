// The paged-attention kernel's AMX path: bf16 queries over bf16 keys on tiles (amx_attend),
// and release_tiles, which hands the tile state back after a thread's last call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "paged_attention.h"
#include "paged_attention_narrow.h"

namespace radixserve_cpu::paged {

#if RADIXSERVE_AMX
// bf16 queries over bf16 keys on AMX tiles (pair_scores_for's case, where the process may use
// them; amx.h). Every block takes this one path, whatever its number of rows, so a decode row
// still equals the prefill row of its position bit for bit: a tile product's value for one
// row and key depends on neither the tile's other rows nor its shape (checked on the 2-core
// Xeon VM). Per block of kBlock keys and up to 16 rows:
//
//   scores   tile S (16 keys x 16 rows) = K (16 keys x 32 dimensions, read in place from a
//            page, where a token's keys lie a stride apart) . Q (16 pairs of dimensions x 16
//            rows), over the head's 32-dimension steps; scaled after, as pair_scores_for's;
//   softmax  masked, exponentiated in base 2, the rows' state rescaled as attend_run's: a
//            decode token's few rows with the keys in the lanes (gathered from S), a
//            prefill's 16 with the rows in them (S's rows as they are), in one order;
//   values   acc (rows x 16 dimensions) += P (rows x 32 keys: the probabilities rounded to
//            bf16, as GPU FlashAttention rounds them) . V (16 pairs of keys x 16 dimensions,
//            interleaved here), for every 16 dimensions and both halves of the block.
//
// Keys past the run's end are zero rows with probability zero, and the value tiles run over
// them as over masked keys: a partial block gives the bits of a masked full one.
//
// The tiles, by number: GCC's tile intrinsics paste the number into their assembly, so these
// are macros of plain literals (undefined after amx_attend). Two of each of the scores and the
// output tiles, so that two chains of products are in flight at a time.
#define TILE_S0 0  // scores: 16 keys x 16 rows, float (S1: the next 16 keys)
#define TILE_S1 1
#define TILE_K 2   // keys: 16 keys x 32 dimensions, bf16; then values: 16 pairs of keys x 16 dimensions
#define TILE_Q 3   // queries: 16 pairs of dimensions x 16 rows, bf16 pairs; then values too
#define TILE_P0 4  // probabilities: rows x the block's first 32 keys, bf16
#define TILE_P1 5  // ... and its last 32
#define TILE_O0 6  // output: rows x 16 dimensions, float (O1: the next 16)
#define TILE_O1 7

alignas(64) constexpr uint16_t kZeroRow[256] = {};  // a padded key's or value's row (d <= 256)

// A thread's value tiles of full blocks (values' layout, kBlock keys each), kept from one row
// block to the next: a prefill's rows are many blocks of 16 over the same keys of one KV
// head, and rebuilding a block's tiles for every 16 rows was a large part of its attention's
// time. Tagged by the layer's value pool, the
// run's page list and the KV head; valid within one kernel call only (release_tiles, which
// every thread runs after its last amx_attend of a call, forgets it: the next call may have
// stored into the pages). Only full blocks are kept, so a kept tile is the bits a rebuild gives.
struct ValueTiles {
  const void* pool = nullptr;
  const int64_t* pages = nullptr;
  int64_t head = -1;
  std::vector<uint16_t> tiles;
  std::vector<char> ready;  // per block of the run: its tiles are built
  static constexpr int64_t kMaxElems = int64_t{8} << 20;  // 16 MB a thread at most; past it, none kept

  // The tiles of block ``b`` (keys b * kBlock..) of ``pages``' run of ``len`` keys, and
  // whether they are built already; null where the run is too long to keep.
  uint16_t* find(const void* v, const int64_t* run_pages, int64_t len, int64_t h, int64_t d, int64_t b, bool& built) {
    const int64_t blocks = (len + kBlock - 1) / kBlock;
    if (blocks * kBlock * d > kMaxElems) return nullptr;
    if (v != pool || run_pages != pages || h != head) {
      pool = v, pages = run_pages, head = h;
      std::fill(ready.begin(), ready.end(), 0);
    }
    if (static_cast<int64_t>(ready.size()) < blocks) ready.resize(blocks, 0);
    if (static_cast<int64_t>(tiles.size()) < blocks * kBlock * d) tiles.resize(blocks * kBlock * d);
    built = ready[b] != 0;
    ready[b] = 1;
    return tiles.data() + b * kBlock * d;
  }
  void forget() { pool = nullptr, pages = nullptr, head = -1; }
  static ValueTiles& local() {
    thread_local ValueTiles kept;
    return kept;
  }
};

// One row block's tile work in amx_attend: its constant operands (permutation indices), and a
// method per stage of a block of kBlock keys. ``lanes``: the block's rows (<= 16); ``n``:
// the block's keys (<= kBlock; the rest padded with zero rows); ``seen(r)``: row r's keys of
// the block, [0, seen); ``mv``, ``lv``: the rows' running max and sum; ``acc``: their rows.
template <int NC>
struct AmxBlocks {
  static constexpr int64_t d = NC * kLanes, steps = d / 32, G = kBlock / kLanes;
  __m512i pick_lo, pick_hi;  // a value tile row's words from two keys' rows (values)
  __m512i column;            // lanes 16 i: row i of the score tile, one lane each (few_rows)
  __m512i pick_rows;         // a probability pair vector's words by row (many_rows)
  vi iota;

  AmxBlocks() {
    // Word w of a value tile's row: dimension w / 2 of the pair's first key (w even) or of its
    // second (the index's bit 5 picks permutex2var's second operand).
    uint16_t lo[32], hi[32], by_row[32];
    for (int w = 0; w < 32; ++w) lo[w] = static_cast<uint16_t>(w / 2 + (w % 2) * 32), hi[w] = lo[w] + 16;
    // Word w of a probability pair vector: row w / 2's probability of the first key (w even,
    // the low half of cvtne2ps's result) or of the second.
    for (int w = 0; w < 32; ++w) by_row[w] = static_cast<uint16_t>(w / 2 + (w % 2) * 16);
    pick_lo = _mm512_loadu_si512(lo), pick_hi = _mm512_loadu_si512(hi), pick_rows = _mm512_loadu_si512(by_row);
    for (int i = 0; i < kLanes; ++i) iota[i] = i;
    column = _mm512_mullo_epi32((__m512i)iota, _mm512_set1_epi32(kLanes));
  }

  // An output row's running sum times the rescaling factor of its softmax state.
  static void scale_row(float* row, float alpha) {
    for (int64_t c = 0; c < NC; ++c) store_vf(row + c * kLanes, load_vf(row + c * kLanes) * alpha);
  }

  // Tile Q's columns: word j * 16 + r = dimensions 2j and 2j + 1 of row r of ``q`` (the floats
  // are bf16 values: their top halves are the bf16 words), zero for rows past ``lanes``.
  static void pair_queries(const float* q, int64_t lanes, uint32_t* tq) {
    std::fill(tq, tq + steps * kLanes * kLanes, 0u);
    for (int64_t r = 0; r < lanes; ++r) {
      for (int64_t j = 0; j < d / 2; ++j) tq[j * kLanes + r] = bf16_pair(q + r * d + 2 * j);
    }
  }

  // Scores, 32 keys at a time: ts row t = key t's score for each of the 16 rows (unscaled).
  // ``stride``: from a token's row to the next one's in the pages, in elements.
  static void scores(const uint16_t* const* krow, int64_t n, int64_t stride, const uint32_t* tq, uint16_t* tk,
                     float* ts) {
    const int64_t groups = (n + kLanes - 1) / kLanes;
    const uint16_t* keys_at[G];
    int64_t ld[G];
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* const* kg = krow + g * kLanes;
      bool in_place = true;  // 16 keys a token's stride apart (on one page)
      for (int64_t i = 1; i < kLanes; ++i) in_place = in_place && kg[i] == kg[0] + i * stride;
      keys_at[g] = kg[0], ld[g] = stride * sizeof(uint16_t);
      if (!in_place) {
        uint16_t* copy = tk + g * kLanes * d;
        for (int64_t i = 0; i < kLanes; ++i) std::memcpy(copy + i * d, kg[i], d * sizeof(uint16_t));
        keys_at[g] = copy, ld[g] = d * sizeof(uint16_t);
      }
    }
    for (int64_t g = 0; g < groups; g += 2) {
      const bool two = g + 1 < groups;
      _tile_zero(TILE_S0);
      _tile_zero(TILE_S1);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(TILE_Q, tq + s * kLanes * kLanes, 64);
        _tile_loadd(TILE_K, keys_at[g] + 32 * s, ld[g]);
        _tile_dpbf16ps(TILE_S0, TILE_K, TILE_Q);
        if (two) {
          _tile_loadd(TILE_K, keys_at[g + 1] + 32 * s, ld[g + 1]);
          _tile_dpbf16ps(TILE_S1, TILE_K, TILE_Q);
        }
      }
      _tile_stored(TILE_S0, ts + g * kLanes * kLanes, 64);
      if (two) _tile_stored(TILE_S1, ts + (g + 1) * kLanes * kLanes, 64);
    }
  }

  // The softmax of a decode token's few rows (lanes <= kNarrowRows): each row's scores
  // gathered from ts with the keys in the lanes (four vectors a row, not 64 mostly idle ones);
  // tp row r: its bf16 probabilities.
  template <typename Seen>
  void few_rows(const float* ts, int64_t n, int64_t lanes, Seen&& seen, float scale, float* mv, float* lv,
                float* acc, uint16_t* tp) const {
    const int64_t groups = (n + kLanes - 1) / kLanes;
    for (int64_t r = 0; r < lanes; ++r) {
      const int32_t keys = static_cast<int32_t>(seen(r));
      vf x[G], top = splat(mv[r]);
      for (int64_t g = 0; g < G; ++g) {
        const vf score =
            g < groups ? static_cast<vf>(_mm512_i32gather_ps(column, ts + g * kLanes * kLanes + r, sizeof(float))) * scale
                       : splat(kNoMax);
        x[g] = iota + static_cast<int32_t>(g * kLanes) < keys ? score : splat(kNoMax);
        top = vmax(top, x[g]);
      }
      const float mx = _mm512_reduce_max_ps(static_cast<__m512>(top));
      const vf vmx = splat(mx);
      vf sum{};
      for (int64_t g = 0; g < G; ++g) {
        const vf p = iota + static_cast<int32_t>(g * kLanes) < keys ? exp2_nonpositive(x[g] - vmx) : vf{};
        sum += p;
        const __m256bh b = _mm512_cvtneps_pbh(static_cast<__m512>(p));
        std::memcpy(tp + r * kBlock + g * kLanes, &b, sizeof b);
      }
      const float alpha = exp2_nonpositive(splat(mv[r]) - vmx)[0];
      mv[r] = mx;
      lv[r] = lv[r] * alpha + lane_sum(sum);
      scale_row(acc + r * d, alpha);
    }
  }

  // The softmax of more rows (a prefill's): the rows in the lanes, ts row t being key t's
  // scores, and per row and key the operations of few_rows: the maximum, exp2, the sum in
  // lane_sum's order (keys i, 16 + i, 32 + i and 48 + i added first, as few_rows adds a row's
  // four vectors), the bf16 probabilities (transposed into tp's rows).
  template <typename Seen>
  void many_rows(const float* ts, int64_t n, int64_t lanes, Seen&& seen, float scale, float* mv, float* lv,
                 float* acc, uint16_t* tp) const {
    const int64_t groups = (n + kLanes - 1) / kLanes;
    vi keys;
    vf vm, vl;
    for (int64_t r = 0; r < kLanes; ++r) {
      keys[r] = r < lanes ? static_cast<int32_t>(seen(r)) : 0;
      vm[r] = r < lanes ? mv[r] : kNoMax;
      vl[r] = r < lanes ? lv[r] : 0.0f;
    }
    // Every row sees every key of a full block (all but a causal diagonal's): no masks there.
    // The maximum in four chains, not one of 64 dependent steps (a maximum is one value in
    // any order: few_rows takes its own order too).
    bool full = n == kBlock;
    for (int64_t r = 0; r < lanes && full; ++r) full = keys[r] >= kBlock;
    vf p[kBlock], tops[4] = {vm, splat(kNoMax), splat(kNoMax), splat(kNoMax)};
    if (full) {
      for (int64_t t = 0; t < kBlock; ++t) {
        p[t] = load_vf(ts + t * kLanes) * scale;
        tops[t % 4] = vmax(tops[t % 4], p[t]);
      }
    } else {
      for (int64_t t = 0; t < kBlock; ++t) {
        const vf score = t < groups * kLanes ? load_vf(ts + t * kLanes) * scale : splat(kNoMax);
        p[t] = vi{} + static_cast<int32_t>(t) < keys ? score : splat(kNoMax);
        tops[t % 4] = vmax(tops[t % 4], p[t]);
      }
    }
    const vf top = vmax(vmax(tops[0], tops[1]), vmax(tops[2], tops[3]));
    if (full) {
      for (int64_t t = 0; t < kBlock; ++t) p[t] = exp2_nonpositive(p[t] - top);
    } else {
      for (int64_t t = 0; t < kBlock; ++t) p[t] = vi{} + static_cast<int32_t>(t) < keys ? exp2_nonpositive(p[t] - top) : vf{};
    }
    const vf alpha = exp2_nonpositive(vm - top);
    vl = vl * alpha + block_sum(p);
    for (int64_t r = 0; r < lanes; ++r) {
      mv[r] = top[r], lv[r] = vl[r];
      scale_row(acc + r * d, alpha[r]);
    }
    // Word r of pairs[j]: row r's probabilities of keys 2j and 2j + 1, as bf16; transposed, a
    // row's 32 words are its 64 keys in order.
    alignas(64) uint32_t pairs[kBlock / 2][kLanes];
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      const __m512bh two = _mm512_cvtne2ps_pbh(static_cast<__m512>(p[2 * j + 1]), static_cast<__m512>(p[2 * j]));
      _mm512_store_si512(pairs[j], _mm512_permutexvar_epi16(pick_rows, (__m512i)two));
    }
    for (int64_t half = 0; half < 2; ++half) {
      const float* src[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) src[i] = reinterpret_cast<const float*>(pairs[half * kLanes + i]);
      __m512 words[kLanes];
      transpose16(src, 0, words);
      for (int64_t r = 0; r < lanes; ++r) _mm512_storeu_ps(reinterpret_cast<float*>(tp + r * kBlock + half * 32), words[r]);
    }
  }

  // acc += P . V: the values as pairs of keys (row i % 16 of half i / 16's tile for dimensions
  // 16c.. holds keys 2i and 2i + 1, dimension by dimension; into ``tv`` unless ``built``
  // there already), then two output tiles at a time.
  // ``ahead(t)``: prefetch the next block's key t, a key at a time (a burst would overflow the
  // miss queues).
  template <typename Ahead>
  void values(const uint16_t* const* vrow, const uint16_t* tp, uint16_t* tv, bool built, float* acc,
              Ahead&& ahead) const {
    for (int64_t i = 0; i < kBlock / 2 && !built; ++i) {
      ahead(2 * i), ahead(2 * i + 1);
      uint16_t* row = tv + ((i / kLanes) * (d / kLanes) * kLanes + i % kLanes) * 32;
      for (int64_t c = 0; c < d / 32; ++c) {
        const __m512i x = _mm512_loadu_si512(vrow[2 * i] + 32 * c), y = _mm512_loadu_si512(vrow[2 * i + 1] + 32 * c);
        _mm512_storeu_si512(row + (2 * c) * kLanes * 32, _mm512_permutex2var_epi16(x, pick_lo, y));
        _mm512_storeu_si512(row + (2 * c + 1) * kLanes * 32, _mm512_permutex2var_epi16(x, pick_hi, y));
      }
    }
    _tile_loadd(TILE_P0, tp, kBlock * sizeof(uint16_t));
    _tile_loadd(TILE_P1, tp + kBlock / 2, kBlock * sizeof(uint16_t));
    const uint16_t* v_half[2] = {tv, tv + (d / kLanes) * kLanes * 32};  // the block's halves' value tiles
    for (int64_t c = 0; c < d / kLanes; c += 2) {  // 32 dimensions at a time (d % 32 == 0)
      float* o = acc + c * kLanes;
      _tile_loadd(TILE_O0, o, d * sizeof(float));
      _tile_loadd(TILE_O1, o + kLanes, d * sizeof(float));
      _tile_loadd(TILE_K, v_half[0] + c * kLanes * 32, 64);
      _tile_dpbf16ps(TILE_O0, TILE_P0, TILE_K);
      _tile_loadd(TILE_Q, v_half[0] + (c + 1) * kLanes * 32, 64);
      _tile_dpbf16ps(TILE_O1, TILE_P0, TILE_Q);
      _tile_loadd(TILE_K, v_half[1] + c * kLanes * 32, 64);
      _tile_dpbf16ps(TILE_O0, TILE_P1, TILE_K);
      _tile_loadd(TILE_Q, v_half[1] + (c + 1) * kLanes * 32, 64);
      _tile_dpbf16ps(TILE_O1, TILE_P1, TILE_Q);
      _tile_stored(TILE_O0, o, d * sizeof(float));
      _tile_stored(TILE_O1, o + kLanes, d * sizeof(float));
    }
  }
};

template <int NC>
void amx_attend(const Layer<c10::BFloat16>& L, int64_t h, KeyRun run, int64_t key_begin, int64_t key_end,
                const float* __restrict q, float scale, int64_t rows, const int32_t* limit, float* __restrict m,
                float* __restrict l, float* __restrict acc, Scratch& sc) {
  using B = AmxBlocks<NC>;
  constexpr int64_t d = B::d;
  static const B blocks;
  const auto* kbase = reinterpret_cast<const uint16_t*>(L.k);
  const auto* vbase = reinterpret_cast<const uint16_t*>(L.v);
  const uint16_t* krow[kBlock];
  const uint16_t* vrow[kBlock];
  int64_t next[kBlock];
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    const int64_t lanes = std::min(kLanes, rows - r0);
    B::pair_queries(q + r0 * d, lanes, sc.tq.data());
    if (sc.tile_rows != lanes) {  // configured once per row count and thread (release_tiles)
      TileConfig cfg;
      for (int t : {TILE_S0, TILE_S1, TILE_K, TILE_Q}) cfg.set(t, kLanes, 64);
      for (int t : {TILE_P0, TILE_P1, TILE_O0, TILE_O1}) cfg.set(t, static_cast<int>(lanes), 64);
      _tile_loadconfig(&cfg);
      sc.tile_rows = lanes;
    }
    float mv[kLanes], lv[kLanes];
    int64_t lim[kLanes], keys = key_end;  // lim: the last key of the run a row may see (causal)
    for (int64_t r = 0; r < lanes; ++r) {
      mv[r] = m[r0 + r], lv[r] = l[r0 + r];
      lim[r] = limit != nullptr ? limit[r0 + r] : key_end - 1;
    }
    if (limit != nullptr) keys = std::min(keys, *std::max_element(lim, lim + lanes) + 1);
    for (int64_t start = key_begin; start < keys; start += kBlock) {
      const int64_t n = std::min(kBlock, keys - start);
      L.offsets(run.pages, h, start, n, [&](int64_t t, int64_t off) {
        krow[t] = kbase + off;
        vrow[t] = vbase + off;
      });
      std::fill(krow + n, krow + kBlock, kZeroRow);
      std::fill(vrow + n, vrow + kBlock, kZeroRow);
      const int64_t next_n = std::min(kBlock, keys - start - n);
      L.offsets(run.pages, h, start + n, next_n, [&](int64_t t, int64_t off) { next[t] = off; });
      B::scores(krow, n, L.kv_heads * d, sc.tq.data(), sc.tk.data(), sc.ts.data());
      auto seen = [&](int64_t r) { return std::min(n, lim[r] - start + 1); };
      float* rows_acc = acc + r0 * d;
      if (lanes <= kNarrowRows) {
        blocks.few_rows(sc.ts.data(), n, lanes, seen, scale, mv, lv, rows_acc, sc.tp.data());
      } else {
        blocks.many_rows(sc.ts.data(), n, lanes, seen, scale, mv, lv, rows_acc, sc.tp.data());
      }
      // A prefill's full blocks: the value tiles this thread built for earlier rows, if any.
      bool built = false;
      uint16_t* tv = lanes > kNarrowRows && n == kBlock
                         ? ValueTiles::local().find(L.v, run.pages, run.len, h, d, start / kBlock, built)
                         : nullptr;
      if (tv == nullptr) tv = sc.tv.data(), built = false;
      blocks.values(vrow, sc.tp.data(), tv, built, rows_acc, [&](int64_t t) {
        if (t < next_n) prefetch_row(L, next[t]);
      });
    }
    for (int64_t r = 0; r < lanes; ++r) m[r0 + r] = mv[r], l[r0 + r] = lv[r];
  }
}
#undef TILE_S0
#undef TILE_S1
#undef TILE_K
#undef TILE_Q
#undef TILE_P0
#undef TILE_P1
#undef TILE_O0
#undef TILE_O1
#endif

// Before amx_attend over keys that are not a pool's pages as they stand for the whole call (a
// quantized chunk decoded into a per-thread tile: the same tile holds another chunk, head or
// sequence at each call): forget the value tiles kept for the earlier contents.
inline void forget_kept_values() {
#if RADIXSERVE_AMX
  ValueTiles::local().forget();
#endif
}

// After a thread's last amx_attend of a kernel call: the tile state back to its initial one
// (nothing for a context switch to save, and no configuration left for other code to meet).
inline void release_tiles([[maybe_unused]] Scratch& sc) {
#if RADIXSERVE_AMX
  if (sc.tile_rows != 0) _tile_release();
  sc.tile_rows = 0;
  ValueTiles::local().forget();
#endif
}

}  // namespace radixserve_cpu::paged
