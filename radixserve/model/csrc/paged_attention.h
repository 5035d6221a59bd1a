// The paged-attention kernel's shared pieces: constants, the per-thread scratch, where a run
// of keys lives (Layer, KeyRun), and the small helpers every path uses. Included by
// paged_attention.cpp (the kernel) and the paths of its own files: paged_attention_narrow.h
// (AVX-512 blocks of a few rows) and paged_attention_amx.h (AMX tiles).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace radixserve_cpu::paged {

constexpr int64_t kBlock = 64;  // keys per online-softmax block
constexpr float kNoMax = -1e30f;  // finite "minus infinity": keeps exp2 arithmetic NaN-free
// Rows per work item: one vector's worth, so that the few dozen decode rows of a group over
// a long shared prefix still spread over the threads (the second item re-reads its keys
// from the shared L3).
constexpr int64_t kRowBlock = kLanes;
// Keys per chunk (a multiple of kBlock): the unit of the merge order above, and of the work a
// decode step spreads over the threads (a 545-key context is 3 chunks per KV head). A prefill
// row block pays a merge and a chunk's setup per chunk: at 128 keys that was ~6 % of the
// last 2,048-row chunk of a 7,500-token prompt (2-core AMD VM, bench_cpu_attention.py's
// ``long``); at 256 its decode steps took the same time (bench_decode_attention.py).
constexpr int64_t kChunk = 4 * kBlock;

// Cache lines a thread will read next (the pages of its next chunk of keys), prefetched a few
// at a time from inside the current chunk's arithmetic (Scratch::stream, attend_run's
// ``ahead``): the reads overlap the arithmetic rather than wait in a pass of their own before
// the chunk. ``per_step`` lines a step, spread so the stream ends before the chunk does.
struct PrefetchStream {
  std::vector<std::pair<const char*, int64_t>> ranges;  // start, bytes (a multiple of 64)
  size_t range = 0;
  int64_t offset = 0, per_step = 0, lines = 0;
  void reset() { ranges.clear(), range = 0, offset = 0, per_step = 0, lines = 0; }
  void add(const char* start, int64_t bytes) { ranges.emplace_back(start, bytes), lines += bytes / 64; }
  void finish() {  // what is left, at once
    const int64_t keep = per_step;
    per_step = INT64_MAX;
    step();
    per_step = keep;
  }
  void step() {
    for (int64_t left = per_step; left > 0 && range < ranges.size();) {
      const char* at = ranges[range].first + offset;
      const int64_t n = std::min(left, (ranges[range].second - offset) / 64);
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(at + 64 * i, 0, 2);
      left -= n, offset += 64 * n;
      if (offset >= ranges[range].second) ++range, offset = 0;
    }
  }
};

// Per-thread scratch for one work item: its rows' pre-scaled queries, softmax state and
// causal limits, and staging for blocks of half-precision keys/values converted to float.
// One per thread, kept across calls and grown on demand: at batch 1 a layer's attention is
// a few microseconds, and allocating (and zeroing) ~40 KB per call was a visible part of it.
// ``m2``, ``l2``, ``acc2``: one chunk's state, before it is merged into ``m``, ``l``, ``acc``.
struct Scratch {
  // ``kt``, ``ps``: a narrow block's transposed keys and probabilities (narrow_block).
  std::vector<float> q, m, l, acc, m2, l2, acc2, kf, vf_, kt, ps;
  std::vector<int32_t> limit, first;  // per row: the last key it sees (causal), the first (window)
  // amx_attend's tile operands: the rows' queries as pairs (``tq``), keys copied where a
  // tile cannot read them in place (``tk``), a block's scores (``ts``), probabilities
  // (``tp``) and values as pairs of keys (``tv``).
  std::vector<uint32_t> tq;
  std::vector<uint16_t> tk, tp, tv;
  std::vector<float> ts;
  // A block's probabilities and values as bf16 pairs of keys (paged_attention_pairs.h).
  std::vector<uint32_t> pw, pv;
  // A quantized run's keys and values decoded (paged_attention_quant.h): room for kChunk
  // rows of d values of the queries' dtype each (float-sized; a chunk where AMX runs, else a
  // block of kBlock), and the page ids of the tile posing as pages (zeros, one per chunk or
  // block of the run).
  std::vector<float> dk, dv;
  std::vector<int64_t> zero_pages;
  // int8 pages in integer arithmetic (paged_attention_int8.h): a block of keys prepared
  // (keys' and values' 16-bit codes, their scales), the rows' queries as 16-bit words, and
  // a block's probabilities as pairs of 16-bit integers (rows in the lanes: kBlock / 2 x 16).
  std::vector<int32_t> int8_keys, int8_values, int8_queries;
  std::vector<float> int8_scales;
  std::vector<uint32_t> int8_probs;
  int64_t tile_rows = 0;  // the rows of the tile configuration loaded on this thread, 0: none
  // While set, a block's ``ahead`` steps ``stream`` (the next chunk's pages, every KV head's)
  // instead of prefetching the block after it in the same run.
  bool streaming = false;
  PrefetchStream stream;
  // While set, attend_run calls it before each block of keys it reads: fill(start, n) puts
  // keys [start, start + n) where the Layer it was given finds them (a quantized run decoded
  // a block at a time into a tile of kBlock rows, Kernel::attend_keys).
  struct Fill {
    void (*fn)(const void* ctx, int64_t start, int64_t n) = nullptr;
    const void* ctx = nullptr;
  } fill;
  // While set (with ``fill``), attend_run's narrow blocks read the run's fp8 codes where they
  // lie instead (paged_attention_fp8.h), and ``fill`` is not called for them.
  const struct Fp8Narrow* fp8 = nullptr;
  void reserve(int64_t d) {
    if (static_cast<int64_t>(q.size()) >= kRowBlock * d) return;
    q.resize(kRowBlock * d), m.resize(kRowBlock), l.resize(kRowBlock), acc.resize(kRowBlock * d);
    m2.resize(kRowBlock), l2.resize(kRowBlock), acc2.resize(kRowBlock * d);
    kf.resize(kBlock * d), vf_.resize(kBlock * d), limit.resize(kRowBlock), first.resize(kRowBlock);
    kt.resize(kBlock * d), ps.resize(kRowBlock * kBlock);
    tq.resize(kLanes * d / 2), tk.resize(kBlock * d), tp.resize(kRowBlock * kBlock), tv.resize(kBlock * d);
    ts.resize(kBlock * kLanes);
    pw.resize(kBlock / 2 * kLanes), pv.resize(kBlock / 2 * d);
    dk.resize(kChunk * d), dv.resize(kChunk * d);
    int8_keys.resize(d / 2 * kBlock), int8_values.resize(kBlock / 2 * d), int8_queries.resize(kRowBlock * d / 2);
    int8_scales.resize(2 * kBlock), int8_probs.resize(kBlock / 2 * kLanes);
  }
  static Scratch& local(int64_t d) {
    thread_local Scratch sc;
    sc.reserve(d);
    return sc;
  }
};

// One task of taking a call's runs whole (WholeRuns decodes them, ValuePairs pairs their
// values): keys [lo, lo + kChunk) of run ``run``, KV head ``head``.
struct ChunkTask {
  int64_t run, head, lo;
};

// Every ChunkTask of ``runs`` (entries with a ``.run``, a KeyRun), run by run, head by head.
template <typename Entries>
void list_chunk_tasks(const Entries& runs, int64_t kv_heads, std::vector<ChunkTask>& tasks) {
  tasks.clear();
  for (int64_t i = 0; i < static_cast<int64_t>(runs.size()); ++i) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t lo = 0; lo < runs[i].run.len; lo += kChunk) tasks.push_back({i, h, lo});
    }
  }
}

// f(task) for thread ``t``'s share of ``tasks``, in a team of ``nt`` (every thread of the
// team calls it, then waits for the others before any row reads a run).
template <typename F>
void for_share(const std::vector<ChunkTask>& tasks, int64_t t, int64_t nt, F&& f) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  for (int64_t j = n * t / nt; j < n * (t + 1) / nt; ++j) f(tasks[j]);
}

// Where a run of keys lives: pages in order, the run's first ``len`` tokens of them; and,
// where the kernel paired them for the call (ValuePairs), the values of the KV head it is
// attended for as pairs of keys (key pair j at vpairs + j * d words), else null.
struct KeyRun {
  const int64_t* pages;
  int64_t len;
  const uint32_t* vpairs = nullptr;
};

// Runs of keys taken whole for one kernel call, for the many rows of a prefill or an extend
// that read them (WholeRuns decodes quantized runs, ValuePairs pairs bf16 values, Int8Runs
// makes int8 blocks ready): each run's words in one buffer on the calling thread, kept across
// calls and grown on demand, never past kMaxBytes (a run that would take it past is not
// taken: its rows take it block by block), and the taking's ChunkTasks. ``Owner``: the class
// that takes them, for a buffer of its own (WholeRuns and ValuePairs are live in one call).
template <typename Word, typename Owner>
class RunBuffer {
 public:
  // Every run of a call, together, at most this many bytes (64 MiB; SmolLM2's 3 KV heads of
  // 64 dimensions at 7,500 keys: 5.8 MB decoded to bf16, 2.9 MB of value pairs, 6 MB of
  // int8 blocks made ready, a layer call).
  static constexpr int64_t kMaxBytes = int64_t{64} << 20;

  RunBuffer(int64_t kv_heads, int64_t d) : kv_heads_(kv_heads), d_(d) {}

  bool empty() const { return runs_.empty(); }
  int64_t size() const { return static_cast<int64_t>(runs_.size()); }
  KeyRun run(int64_t i) const { return runs_[i].run; }

  // Make room for every run taken and list the tasks (kChunk keys of one KV head each), on
  // the calling thread, before any thread takes its share.
  void prepare() {
    thread_local std::vector<Word> buf;  // the calling thread's; see above
    if (static_cast<int64_t>(buf.size()) < words_) buf.resize(words_);
    base_ = buf.data();
    list_chunk_tasks(runs_, kv_heads_, tasks_);
  }

 protected:
  // Take ``run`` (its first run.len keys) at ``words`` words: its index, or -1 where it would
  // pass the bound.
  int64_t take(KeyRun run, int64_t words) {
    if (run.len <= 0 || (words_ + words) * static_cast<int64_t>(sizeof(Word)) > kMaxBytes) return -1;
    runs_.push_back({run, words_});
    words_ += words;
    return size() - 1;
  }

  // f(task) for thread ``t``'s share of the tasks, in a team of ``nt`` (for_share). Inside the
  // kernel's own parallel region: a team of its own would cost another fork and join per call.
  template <typename F>
  void share(int64_t t, int64_t nt, F&& f) const {
    for_share(tasks_, t, nt, f);
  }

  // Run ``i``'s words.
  Word* words(int64_t i) const { return base_ + runs_[i].offset; }

  int64_t kv_heads_, d_;

 private:
  struct Entry {
    KeyRun run;
    int64_t offset;  // of its words in the buffer
  };
  int64_t words_ = 0;
  std::vector<Entry> runs_;
  std::vector<ChunkTask> tasks_;
  Word* base_ = nullptr;
};

template <typename KV>
struct Layer {
  const KV* k;
  const KV* v;
  int64_t page_size, kv_heads, d;
  // Offset of token ``t`` of ``page`` for KV head ``h``, in elements.
  int64_t at(int64_t page, int64_t t, int64_t h) const { return ((page * page_size + t) * kv_heads + h) * d; }
  // put(i, offset) for the keys pos .. pos + n - 1 of a run in ``pages``, KV head ``h`` (one
  // division for the run and one offset per page, not per key: a key is the one before it
  // plus a token's stride; a page's keys in a loop of their own, with no branch per key:
  // a decode row's narrow blocks spent a visible share of their time in the per-key one).
  template <typename Put>
  void offsets(const int64_t* pages, int64_t h, int64_t pos, int64_t n, Put&& put) const {
    const int64_t stride = kv_heads * d;
    int64_t page = pos / page_size, t = pos % page_size;
    for (int64_t i = 0; i < n; ++page, t = 0) {  // a page's id is read only when a key lies on it
      const int64_t keys = std::min(page_size - t, n - i), off = at(pages[page], t, h);
      for (int64_t j = 0; j < keys; ++j) put(i + j, off + j * stride);
      i += keys;
    }
  }
};

// Prefetch one token's K row (and V row, unless ``values`` is false; ``off`` in elements)
// into the cache.
template <typename KV>
inline void prefetch_row(const Layer<KV>& L, int64_t off, bool values = true) {
  for (int64_t b = 0; b < L.d * static_cast<int64_t>(sizeof(KV)); b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(L.k + off) + b, 0, 1);
    if (values) __builtin_prefetch(reinterpret_cast<const char*>(L.v + off) + b, 0, 1);
  }
}

// A block's probability sum, in one order on every path: a row's keys i, 16 + i, 32 + i and
// 48 + i added first, in that order, then those 16 partial sums in lane_sum's tree, so that
// keys in the lanes (a decode row's narrow block, the AMX few rows) and rows in the lanes (a
// prefill's block) give a row the same bits. A tree, not a chain of 64 dependent adds.
static_assert(kBlock == 4 * kLanes, "a block's sum adds four vectors of keys");
// The sum of a vector's lanes in one fixed order: lane j and j + 8 first, then those sums' j
// and j + 4, then j and j + 2, then the last two (lanes_sum below: the same for each lane of
// 16 vectors, so rows in the lanes and a row's keys in the lanes sum alike).
inline float lane_sum(vf s) {
  const vf h = s + __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  const vf q = h + __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const vf e = q + __builtin_shufflevector(q, q, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return e[0] + e[1];
}

// lane_sum of every lane r of the vectors s[i] (i the summed index): a vector of 16 sums.
inline vf lanes_sum(const vf (&s)[kLanes]) {
  vf h[8], q[4], e[2];
  for (int j = 0; j < 8; ++j) h[j] = s[j] + s[j + 8];
  for (int j = 0; j < 4; ++j) q[j] = h[j] + h[j + 4];
  for (int j = 0; j < 2; ++j) e[j] = q[j] + q[j + 2];
  return e[0] + e[1];
}

// A rows-in-lanes block's probability sums, lane r row r's: its keys i, 16 + i, 32 + i and
// 48 + i first, then lanes_sum (the block sum's order above; every rows-in-lanes path sums
// its blocks here).
inline vf block_sum(const vf (&p)[kBlock]) {
  vf part[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) part[i] = ((p[i] + p[kLanes + i]) + p[2 * kLanes + i]) + p[3 * kLanes + i];
  return lanes_sum(part);
}

// cap * tanh(x / cap) over the lanes, tanh from exp2v (odd; the exponent is never positive).
inline vf soft_cap(vf x, float cap) {
  const vf y = x / cap;
  const auto neg = y < vf{};
  const vf e = exp2v((neg ? y : -y) * (2.0f * kLog2e));
  const vf t = (1.0f - e) / (1.0f + e);
  return (neg ? -t : t) * cap;
}

// Rows of one block of keys: float pages are read in place, others converted into ``buf``.
template <typename KV>
const float* block_rows(const KV* const* src, int64_t n, int64_t d, float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < d; ++j) buf[t * d + j] = to_float(src[t][j]);
  }
  return buf;
}

// acc rows ``r``.. (``R`` of them) = acc * alpha + sum_t prob(t, r) * v[t]: NC vectors of
// columns per row, R rows together, so R * NC independent FMA chains hide the FMA latency.
// ``prob(t, r)``: the probability of key t for row r, wherever the caller keeps it; ``vr``:
// the value rows, float or a dtype load_as_vf widens (exactly) as it goes.
template <int NC, int R, typename Prob, typename V>
inline void accumulate_pv(float* __restrict acc, int64_t r, const vf alpha, Prob&& prob, const V* const* vr,
                          int64_t n) {
  constexpr int64_t d = NC * kLanes;
  vf x[R][NC];
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < NC; ++c) x[i][c] = load_vf(acc + (r + i) * d + c * kLanes) * alpha[r + i];
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int c = 0; c < NC; ++c) {
      const vf v = load_as_vf(vr[t] + c * kLanes);
      for (int i = 0; i < R; ++i) x[i][c] += prob(t, r + i) * v;
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < NC; ++c) store_vf(acc + (r + i) * d + c * kLanes, x[i][c]);
  }
}

// acc += the block's probabilities times its values, for rows [0, lanes): two rows at a time
// where the registers allow, then one (the arithmetic of a row is the same either way).
template <int NC, typename Prob, typename V>
inline void accumulate_rows(float* acc, int64_t lanes, const vf alpha, Prob&& prob, const V* const* vr, int64_t n) {
  int64_t r = 0;
  if constexpr (NC <= 8) {
    for (; r + 2 <= lanes; r += 2) accumulate_pv<NC, 2>(acc, r, alpha, prob, vr, n);
  }
  for (; r < lanes; ++r) accumulate_pv<NC, 1>(acc, r, alpha, prob, vr, n);
}

// Whether narrow_block multiplies a block's values as they lie in the pages (float, and bf16
// where a vector widens it), rather than converted rows.
template <typename KV>
constexpr bool narrow_widens = std::is_same_v<KV, float> || (std::is_same_v<KV, c10::BFloat16> && RADIXSERVE_VEC_BF16);
// Whether a block's keys must be converted to float rows before narrow_block (which
// transposes float keys, and bf16 keys of an even number of vectors, itself).
template <int NC, typename KV>
constexpr bool narrow_reads_rows = !(std::is_same_v<KV, float> || (std::is_same_v<KV, c10::BFloat16> && NC % 2 == 0));

// Whether bf16 queries score bf16 keys of head_dim d by pairs of dimensions: vdpbf16ps adds a
// pair's two exact products to a float sum, the odd dimension's and then the even one's, each
// rounded once (the FMAs fma(q_2i, k_2i, fma(q_2i+1, k_2i+1, s)), checked bit for bit on
// AVX-512 bf16 hardware), half the instructions of a float FMA per dimension and no widening
// of the keys. Every path runs that instruction: a decode row's narrow blocks with a query
// pair broadcast over keys in the lanes, a prefill's rows-in-lanes blocks with a key pair
// broadcast (from the page, never converted) over rows in the lanes, so they agree bit for bit.
// The queries are used unscaled (the bf16 values themselves), the score scaled after.
// Even numbers of key vectors only: the keys are transposed as pairs of vectors (NC even).
template <typename Q, typename KV>
constexpr bool pair_scores_for(int64_t d) {
  return RADIXSERVE_VEC_BF16 && std::is_same_v<Q, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16> &&
         d % (2 * kLanes) == 0;
}

// A pair of bf16 values held as floats (their top halves are the bf16 words) as one 32-bit
// word of two bf16: x[0] in the low half, x[1] in the high one (vdpbf16ps's and the tiles'
// operand order).
inline uint32_t bf16_pair(const float* x) {
  uint32_t even, odd;
  std::memcpy(&even, x, sizeof even);
  std::memcpy(&odd, x + 1, sizeof odd);
  return (odd & 0xffff0000u) | (even >> 16);
}

}  // namespace radixserve_cpu::paged
