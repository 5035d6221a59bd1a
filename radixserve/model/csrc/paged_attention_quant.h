// The paged-attention kernel over quantized pages (int8 codes with a scale per token and KV
// head; fp8 e4m3 / e5m2 codes with a static scale per KV head; the layout of
// radixkernels/kv_format.py): a run's keys and values are decoded a chunk at a time into a
// per-thread tile of the queries' dtype, and the unquantized kernel attends over that tile
// as over a page of its own (so AMX, the narrow blocks and the chunk order all apply).
//
// The decoding is the torch path's, value for value: code -> float32, times the scale in
// float32 (dequantize_ref's ``x.float().mul_(s)``), rounded once to the queries' dtype (its
// ``.to(q.dtype)``). A decode step thus reads one byte per element from memory, not two.
#pragma once

#include <cstdint>
#include <cstring>

#include "paged_attention.h"
#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_cpu::paged {

enum class Codes { kInt8, kFp8E4M3, kFp8E5M2 };

// A layer's quantized pages: codes [num_pages, page_size, kv_heads, d] of one byte each, and
// scales: per (slot, KV head) for int8 ([num_pages, page_size, kv_heads]), per KV head for fp8.
struct QuantPages {
  const uint8_t* k;
  const uint8_t* v;
  const float* k_scale;
  const float* v_scale;
  Codes codes;
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

// Keys [lo, hi) of ``run`` for KV head ``h``, decoded into rows ``dk``/``dv`` ([kChunk, d]),
// key i at row i - base. ``geo``: the pages' geometry (its k/v unused).
template <typename T, typename G>
void decode_keys(const Layer<G>& geo, const QuantPages& qp, int64_t h, KeyRun run, int64_t base, int64_t lo,
                 int64_t hi, T* __restrict dk, T* __restrict dv) {
  const int64_t d = geo.d;
  const bool token_scales = qp.codes == Codes::kInt8;
  geo.offsets(run.pages, h, lo, hi - lo, [&](int64_t i, int64_t off) {
    const int64_t row = (lo + i - base) * d;
    const float ks = token_scales ? qp.k_scale[off / d] : qp.k_scale[h];
    const float vs = token_scales ? qp.v_scale[off / d] : qp.v_scale[h];
    for (int64_t j = 0; j < d; j += kLanes) {
      store_from_vf(dk + row + j, codes_as_vf(qp.k + off + j, qp.codes) * ks);
      store_from_vf(dv + row + j, codes_as_vf(qp.v + off + j, qp.codes) * vs);
    }
  });
}

}  // namespace radixserve_cpu::paged
