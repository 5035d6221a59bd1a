// The paged-attention kernel over quantized pages (int8 codes, and int4 codes of
// Hadamard-rotated rows, with a scale per token and KV head; fp8 e4m3 / e5m2 codes with a
// static scale per KV head; the layout of radixkernels/kv_format.py): a run's keys and
// values are decoded a block of 64 at a time, as the unquantized kernel comes to them, into
// a per-thread tile of the queries' dtype that it attends over as over pages of its own (so
// the narrow blocks and the chunk order all apply; where AMX runs, a chunk at a time: its
// value tiles are kept by address).
//
// The decoding is the torch path's, value for value: code -> float32, times the scale in
// float32 (dequantize_ref's ``x.float().mul_(s)``), rounded once to the queries' dtype (its
// ``.to(q.dtype)``); int4's are the rotated row's values, attended in that basis
// (hadamard.h), so not the torch path's bits. A decode step thus reads one byte per element
// from memory, not two (int4: half a byte).
// A prefill's or an extend's many rows instead take their runs decoded whole, once per call
// (WholeRuns below), and attend over those as over unquantized pages.
// (bf16 queries over int8 pages, on AVX-512 VNNI without AMX, take integer products over the
// codes instead: paged_attention_int8.h.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "hadamard.h"
#include "paged_attention.h"
#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_cpu::paged {

enum class Codes { kInt8, kFp8E4M3, kFp8E5M2, kInt4 };

// Whether ``codes`` carry a scale per (slot, KV head) (int8, int4), not one per KV head (fp8).
inline bool token_scaled(Codes codes) { return codes == Codes::kInt8 || codes == Codes::kInt4; }
inline bool is_fp8(Codes codes) { return codes == Codes::kFp8E4M3 || codes == Codes::kFp8E5M2; }

// A layer's quantized pages: codes [num_pages, page_size, kv_heads, d] of one byte each (int4:
// two a byte, [.., d / 2], element 2i in the low nibble, 2i + 1 in the high one, each q + 8),
// and scales: per (slot, KV head) for int8 and int4 ([num_pages, page_size, kv_heads]), per
// KV head for fp8. int4 rows are Hadamard-rotated (kv_format.py): their codes decode to the
// rotated row x H, and the kernel attends in that basis (hadamard.h).
struct QuantPages {
  const uint8_t* k;
  const uint8_t* v;
  const float* k_scale;
  const float* v_scale;
  Codes codes;
  // The bytes of ``n`` elements' codes (n even where int4).
  int64_t bytes(int64_t n) const { return codes == Codes::kInt4 ? n / 2 : n; }
};

// kLanes codes from ``p`` as floats (exact: every code is a float).
inline vf codes_as_vf(const uint8_t* p, Codes codes) {
  vi x;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (codes == Codes::kInt8) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    vf out;
    std::memcpy(&out, &f, sizeof out);
    return out;
  }
  const __m512i wide = _mm512_cvtepu8_epi32(bytes);
  std::memcpy(&x, &wide, sizeof x);
#else
  for (int64_t i = 0; i < kLanes; ++i) x[i] = codes == Codes::kInt8 ? static_cast<int8_t>(p[i]) : p[i];
  if (codes == Codes::kInt8) return __builtin_convertvector(x, vf);
#endif
  const vi sign = (x & 0x80) << 24;
  // fp8 as float bits: the exponent re-biased, the mantissa moved up; subnormal codes
  // (exponent 0) are mantissa x 2^(1 - bias - mantissa bits); all-ones exponents are NaN
  // (e4m3: only with mantissa 7; e5m2: infinities with mantissa 0).
  const bool e4 = codes == Codes::kFp8E4M3;
  const int mbits = e4 ? 3 : 2, bias = e4 ? 7 : 15, emax = e4 ? 15 : 31;
  const vi e = (x >> mbits) & emax, m = x & ((1 << mbits) - 1);
  const vi normal = sign | ((e + (127 - bias)) << 23) | (m << (23 - mbits));
  const vf sub = __builtin_convertvector(m, vf) * (e4 ? 0x1p-9f : 0x1p-16f);
  const vi subnormal = sign | (vi)sub;
  const vi nan = vi{} + 0x7fc00000;
  const vi inf = sign | 0x7f800000;
  const vi special = e4 ? (m == 7 ? nan : normal) : (m == 0 ? inf : nan);
  const vi bits = e == 0 ? subnormal : (e == emax ? special : normal);
  return (vf)bits;
}

#if RADIXSERVE_VEC_BF16 && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define RADIXSERVE_FP8_BYTES 1
// fp8 codes to bf16 by a table: every fp8 e4m3 / e5m2 value is a bf16 value (3 or 2 mantissa
// bits of bf16's 7, an exponent within its range), so with a scale of 1.0 (fp8's default)
// the torch path's float32 product rounded to bf16 is the code's bf16 value itself. The
// table holds the bf16 words of codes 0..127 (the sign is the code's top bit) as bytes: their
// low bytes in two registers of 64, their high bytes in two more. A byte permute over two
// registers (VBMI's vpermt2b) reads 128 entries by the low 7 bits of each index and ignores
// the top one, so the codes themselves are the indices: 64 codes take two permutes and the
// sign, then two unpacks make them words (against a widening, two word permutes, a blend and
// the sign per 32 codes by a table of words).
struct Fp8Bytes {
  __m512i lo[2], hi[2];
  explicit Fp8Bytes(Codes codes) {
    alignas(64) uint8_t low[128], high[128];
    for (int c = 0; c < 128; c += kLanes) {
      uint8_t b[kLanes];
      for (int i = 0; i < kLanes; ++i) b[i] = static_cast<uint8_t>(c + i);
      const vf f = codes_as_vf(b, codes);
      for (int i = 0; i < kLanes; ++i) {
        uint32_t bits;
        const float x = f[i];
        std::memcpy(&bits, &x, sizeof bits);  // a bf16 value: the low half is zero
        low[c + i] = static_cast<uint8_t>(bits >> 16);
        high[c + i] = static_cast<uint8_t>(bits >> 24);
      }
    }
    for (int i = 0; i < 2; ++i) {
      lo[i] = _mm512_load_si512(low + 64 * i);
      hi[i] = _mm512_load_si512(high + 64 * i);
    }
  }
  // The bf16 words of the 64 codes in ``x``, by 128-bit lanes: lane l of ``a`` holds those of
  // codes 16 l .. 16 l + 7, lane l of ``b`` those of codes 16 l + 8 .. 16 l + 15 (vpunpck*bw).
  // Always inlined, as transpose16: its callers keep the table in registers across a block.
  __attribute__((always_inline)) void words(__m512i x, __m512i& a, __m512i& b) const {
    const __m512i low = _mm512_permutex2var_epi8(lo[0], x, lo[1]);
    const __m512i mag = _mm512_permutex2var_epi8(hi[0], x, hi[1]);
    const __m512i high = _mm512_ternarylogic_epi32(mag, x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // mag | (x & 0x80)
    a = _mm512_unpacklo_epi8(low, high);
    b = _mm512_unpackhi_epi8(low, high);
  }
  // 64 codes from ``src`` as bf16 words into ``dst``, in order.
  void row64(const uint8_t* src, c10::BFloat16* dst) const {
    __m512i a, b;
    words(_mm512_loadu_si512(src), a, b);
    // Lanes in order: a's lane 0, b's lane 0, a's lane 1, ... (quadwords of a, then of b).
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi64(a, first, b));
    _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi64(a, second, b));
  }
  static const Fp8Bytes& of(Codes codes) {
    static const Fp8Bytes e4m3(Codes::kFp8E4M3), e5m2(Codes::kFp8E5M2);
    return codes == Codes::kFp8E4M3 ? e4m3 : e5m2;
  }
};
#else
#define RADIXSERVE_FP8_BYTES 0
#endif

#if RADIXSERVE_VEC_BF16 && defined(__AVX512BW__)
// 32 int8 codes times ``scale``, rounded to bf16 into ``dst``: the values codes_as_vf and
// store_from_vf give 16 at a time (float products, then round to nearest even), one
// conversion of two vectors and one store per 32; each 16 codes' load feeds its widening.
inline void int8_row32(const uint8_t* src, __m512 scale, c10::BFloat16* dst) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
  const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), scale);
  const __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), scale);
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// A key's ``d`` int8 codes of K and of V (d a multiple of 32) into bf16 rows, K's and V's
// 32 at a time side by side (two independent chains: a row of 64 is only two steps each).
inline void int8_rows(const uint8_t* k, const uint8_t* v, float ks, float vs, int64_t d, c10::BFloat16* dk,
                      c10::BFloat16* dv) {
  const __m512 a = _mm512_set1_ps(ks), b = _mm512_set1_ps(vs);
  for (int64_t j = 0; j < d; j += 32) {
    int8_row32(k + j, a, dk + j);
    int8_row32(v + j, b, dv + j);
  }
}
#endif

// A row of ``d`` int4 codes (``d / 2`` bytes at ``src``) times ``scale``, rounded to T into
// ``dst``: each (nibble - 8) as a float times the scale in float32, rounded once, as
// decode_keys rounds int8's (of the rotated row: QuantPages).
template <typename T>
inline void int4_row(const uint8_t* __restrict src, float scale, int64_t d, T* __restrict dst) {
#if RADIXSERVE_VEC_BF16 && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (d % 32 == 0) {
      // A nibble has 16 values: the row's 16 products, rounded to bf16 once, are a table
      // (twice over: a word permute, vpermw, reads 32 entries by an index's low 5 bits) that
      // each 32 codes look up in one permute, rather than widening, converting, scaling and
      // rounding each of them: fewer instructions where int4's decode rows wait on this
      // decoding, not on their reads (benchmarks/long_context.md, "int4 KV in the kernel").
      const __m512 values = _mm512_mul_ps(
          _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_ps(scale));
      const __m512i table = _mm512_broadcast_i64x4((__m256i)_mm512_cvtneps_pbh(values));
      for (int64_t j = 0; j < d; j += 32) {
        // Byte i (codes 2i, 2i + 1) as dword i, then b | b << 12: its word 2i's low 4 bits are
        // the low nibble, word 2i + 1 is the high nibble. What else lands in word 2i (bit 4,
        // the high nibble's lowest; bits 12-15) vpermw ignores or the doubled table absorbs.
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j / 2)));
        const __m512i index = _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
        _mm512_storeu_si512(dst + j, _mm512_permutexvar_epi16(index, table));
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < d; j += 2) {
    const int b = src[j / 2];
    dst[j] = from_float<T>(static_cast<float>((b & 15) - 8) * scale);
    dst[j + 1] = from_float<T>(static_cast<float>((b >> 4) - 8) * scale);
  }
}

// Keys [lo, hi) of ``run`` for KV head ``h``, decoded into rows ``dk``/``dv`` ([kChunk, d]),
// key i at row i - base. ``geo``: the pages' geometry (its k/v unused).
template <typename T, typename G>
void decode_keys(const Layer<G>& geo, const QuantPages& qp, int64_t h, KeyRun run, int64_t base, int64_t lo,
                 int64_t hi, T* __restrict dk, T* __restrict dv) {
  const int64_t d = geo.d;
  const bool token_scales = token_scaled(qp.codes);
#if RADIXSERVE_FP8_BYTES
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (!token_scales && qp.k_scale[h] == 1.0f && qp.v_scale[h] == 1.0f) {  // fp8 at scale 1: the table
      const Fp8Bytes& table = Fp8Bytes::of(qp.codes);
      geo.offsets(run.pages, h, lo, hi - lo, [&](int64_t i, int64_t off) {
        const int64_t row = (lo + i - base) * d;
        int64_t j = 0;
        for (; j + 64 <= d; j += 64) {
          table.row64(qp.k + off + j, dk + row + j);
          table.row64(qp.v + off + j, dv + row + j);
        }
        for (; j < d; j += kLanes) {  // the last 16s (head_dim 16, 80, 96)
          store_from_vf(dk + row + j, codes_as_vf(qp.k + off + j, qp.codes));
          store_from_vf(dv + row + j, codes_as_vf(qp.v + off + j, qp.codes));
        }
      });
      return;
    }
  }
#endif
  // A slot's scale index is its offset over d: a shift where d is a power of two (every head
  // size but 80 and 96), not a 64-bit division per key.
  const int shift = (d & (d - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(d)) : -1;
  if (qp.codes == Codes::kInt4) {  // d a power of two; a row's nibbles at half its offset
    geo.offsets(run.pages, h, lo, hi - lo, [&](int64_t i, int64_t off) {
      const int64_t row = (lo + i - base) * d, slot = off >> shift;
      int4_row(qp.k + off / 2, qp.k_scale[slot], d, dk + row);
      int4_row(qp.v + off / 2, qp.v_scale[slot], d, dv + row);
    });
    return;
  }
#if RADIXSERVE_VEC_BF16 && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (token_scales && d % 32 == 0) {  // int8 to bf16, 32 codes at a time
      geo.offsets(run.pages, h, lo, hi - lo, [&](int64_t i, int64_t off) {
        const int64_t row = (lo + i - base) * d;
        const int64_t slot = shift >= 0 ? off >> shift : off / d;
        int8_rows(qp.k + off, qp.v + off, qp.k_scale[slot], qp.v_scale[slot], d, dk + row, dv + row);
      });
      return;
    }
  }
#endif
  geo.offsets(run.pages, h, lo, hi - lo, [&](int64_t i, int64_t off) {
    const int64_t row = (lo + i - base) * d;
    const int64_t slot = shift >= 0 ? off >> shift : off / d;
    const float ks = token_scales ? qp.k_scale[slot] : qp.k_scale[h];
    const float vs = token_scales ? qp.v_scale[slot] : qp.v_scale[h];
    for (int64_t j = 0; j < d; j += kLanes) {
      store_from_vf(dk + row + j, codes_as_vf(qp.k + off + j, qp.codes) * ks);
      store_from_vf(dv + row + j, codes_as_vf(qp.v + off + j, qp.codes) * vs);
    }
  });
}

// Quantized runs decoded whole, once per kernel call, for the many rows of a prefill or an
// extend (RunBuffer). Decoded in the per-thread tile, every block of kRowBlock query rows
// decodes every key it sees again (a 2,048-token chunk of SmolLM2 is 384 blocks per KV head
// over the same keys), and the per-thread tile cannot keep AMX value tiles (it holds another
// chunk at each call). A run decoded here lies still for the whole call: its rows attend over
// it as over a pool of one page, kept value tiles and all (ValueTiles keys them by this
// buffer's address, valid within the call, as for a pool's pages). The values are
// decode_keys' own, so the outputs are the per-chunk path's bit for bit.
template <typename T>
class WholeRuns : public RunBuffer<T, WholeRuns<T>> {
  using Base = RunBuffer<T, WholeRuns<T>>;

 public:
  using Base::Base;

  // Take ``run`` to be decoded whole: its index, or -1 (the caller decodes it in the tile).
  int64_t add(KeyRun run) { return this->take(run, 2 * this->kv_heads_ * run.len * this->d_); }

  // Thread ``t`` of a team of ``nt``: its share of the decoding (RunBuffer::share).
  // ``decoded(i, h, lo)``: keys [lo, lo + kChunk) of run ``i``, KV head ``h``, are decoded
  // (on the thread that decoded them, before it goes on).
  template <typename G, typename Decoded>
  void decode_share(const Layer<G>& geo, const QuantPages& qp, int64_t t, int64_t nt, Decoded&& decoded) const {
    this->share(t, nt, [&](const ChunkTask& task) {
      const KeyRun run = this->run(task.run);
      const int64_t hi = std::min(run.len, task.lo + kChunk);
      T* k = keys(task.run, task.head);
      decode_keys(geo, qp, task.head, run, 0, task.lo, hi, k, k + this->kv_heads_ * run.len * this->d_);
      decoded(task.run, task.head, task.lo);
    });
  }

  // Run ``i`` decoded, KV head ``h``: a pool of one page of run.len tokens and one KV head
  // (its page id: ``kOnePage``'s).
  Layer<T> layer(int64_t i, int64_t h) const {
    return {keys(i, h), values(i, h), this->run(i).len, 1, this->d_};
  }
  static constexpr int64_t kOnePage[1] = {0};

  // Run ``i``'s keys of KV head ``h`` ([len, d]); its values follow kv_heads * len * d later.
  // (A run's words: [kv_heads, len, d] keys, then the values alike.)
  T* keys(int64_t i, int64_t h) const { return this->words(i) + h * this->run(i).len * this->d_; }
  const T* values(int64_t i, int64_t h) const { return keys(i, h) + this->kv_heads_ * this->run(i).len * this->d_; }
};

}  // namespace radixserve_cpu::paged
