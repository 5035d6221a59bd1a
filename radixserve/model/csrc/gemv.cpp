// Linear layers at decode row counts (a few to a few dozen activation rows) for the CPU:
// y[m, n] = sum_k x[m, k] * w[n, k], the weight streamed from memory once per call.
//
// At one row a linear is a GEMV bound by the bytes of the weight; the BLAS/oneDNN paths
// reach ~12-20 GB/s there (bf16 and fp32 on the project's 2-core AVX-512 VM) and torch's
// int8/int4 weight-only kernels decode the weight again for every row. These kernels read
// the weight in place (row-major [N, K]; int4 in this file's nibble layout, see below),
// decode a vector of it into registers once and multiply it with every row of the batch:
//
//   fp32  x fp32   FMA, float32 accumulation
//   bf16  x bf16   vdpbf16ps (pairs of exact bf16 products, float32 accumulation)
//   int4  x bf16   a nibble q OR-ed into 0x4300 is bf16(128 + q) exactly; per group g
//                  y += s_g * sum(v x) and, once per output, y += sum_g (z_g - 136 s_g) X_g
//                  with X_g = sum of the row's x over the group (w = (q - 8) s + z).
//
// Every output's sum runs in one fixed order (vectors of k in order, one horizontal
// reduction at the end) that does not depend on how many rows the call has or where a row
// sits in it: row i of an M-row call equals the 1-row call on row i bit for bit (the
// quantized engine's exact-reproducibility tests rely on it).
//
// int8 (gemv_int8.cpp) keeps its weight in a block layout and multiplies in the outer-product
// form instead, at every row count.
//
// Threads: at::parallel_for over blocks of outputs (torch's pool, no oversubscription).
// Built only where the compiler targets AVX-512 with bf16 dot products (-march=native);
// elsewhere ``gemv_supported()`` is false and the Python side keeps torch's kernels.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv.h"

namespace {

using namespace radixserve_cpu::gemv;

bool gemv_supported() { return RADIXSERVE_GEMV; }

#if RADIXSERVE_GEMV

// --- weight decoders: the k-vector v of output n as a register -----------------------------

// fp32 x fp32: 16 k per vector.
struct F32 {
  using W = __m512;
  using X = __m512;
  static constexpr int64_t kVec = 16;
  const float* w;
  int64_t ldw;
  W load(int64_t n, int64_t k0) const { return _mm512_loadu_ps(w + n * ldw + k0); }
  const void* at(int64_t n, int64_t k0) const { return w + n * ldw + k0; }
  W load_tail(int64_t n, int64_t k0, int64_t len) const {
    return _mm512_maskz_loadu_ps(tail_mask16(len), w + n * ldw + k0);
  }
  static X load_x(const float* x, int64_t k0) { return _mm512_loadu_ps(x + k0); }
  static X load_x_tail(const float* x, int64_t k0, int64_t len) {
    return _mm512_maskz_loadu_ps(tail_mask16(len), x + k0);
  }
  static __m512 dot(__m512 acc, W w, X x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bf16 x bf16: 32 k per vector.
struct BF16 {
  using W = __m512bh;
  using X = __m512bh;
  static constexpr int64_t kVec = 32;
  const uint16_t* w;
  int64_t ldw;
  W load(int64_t n, int64_t k0) const { return (__m512bh)_mm512_loadu_si512(w + n * ldw + k0); }
  const void* at(int64_t n, int64_t k0) const { return w + n * ldw + k0; }
  W load_tail(int64_t n, int64_t k0, int64_t len) const {
    return (__m512bh)_mm512_maskz_loadu_epi16(tail_mask32(len), w + n * ldw + k0);
  }
  static X load_x(const uint16_t* x, int64_t k0) { return (__m512bh)_mm512_loadu_si512(x + k0); }
  static X load_x_tail(const uint16_t* x, int64_t k0, int64_t len) {
    return (__m512bh)_mm512_maskz_loadu_epi16(tail_mask32(len), x + k0);
  }
  static __m512 dot(__m512 acc, W w, X x) { return _mm512_dpbf16_ps(acc, w, x); }
};

// How far ahead of its reads a stream of ``row_streams`` prefetches: ~4 KB in flight per
// stream covers the memory latency at this machine's bandwidth (1, 2, 4 and 8 KB measured;
// 4 KB best).
constexpr int64_t kStreamAhead = 4096;

// One activation row times the outputs n[0..S) (far apart: S address-ordered streams, which
// keep more of the memory's bandwidth busy than one), each output's vectors of k in order
// and one _mm512_reduce_add_ps. ``row_streams`` below does the same for MT rows; kept apart
// because its one-row instantiation ran ~10 % slower at batch 1 (benchmarks/
// bench_gemv_rows.py; the cause was not found), and batch 1 is the common decode step.
template <int S, typename D, typename T>
inline void row_streams1(const D& d, const T* x, int64_t k, const int64_t (&n)[S], float (&out)[S]) {
  __m512 acc[S];
#pragma GCC unroll 4
  for (int i = 0; i < S; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k0 = 0;
  for (; k0 + D::kVec <= k; k0 += D::kVec) {
    const typename D::X xv = D::load_x(x, k0);
#pragma GCC unroll 4
    for (int i = 0; i < S; ++i) {
      _mm_prefetch(static_cast<const char*>(d.at(n[i], k0)) + kStreamAhead, _MM_HINT_T0);
      acc[i] = D::dot(acc[i], d.load(n[i], k0), xv);
    }
  }
  if (k0 < k) {
    const int64_t len = k - k0;
    const typename D::X xv = D::load_x_tail(x, k0, len);
#pragma GCC unroll 4
    for (int i = 0; i < S; ++i) acc[i] = D::dot(acc[i], d.load_tail(n[i], k0, len), xv);
  }
#pragma GCC unroll 4
  for (int i = 0; i < S; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}

// MT activation rows (``x``, ``ldx`` apart) times the outputs n[0..S): each weight vector is
// loaded once and multiplied with every row, and each (output, row) sums exactly as
// row_streams1 sums a row (vectors of k in order, the reduce_add tree): the same bits as a
// one-row call, whatever the call's row count. ``ahead`` 0: no prefetching (a later block of
// rows, which finds the weight in L1); else each stream prefetches kStreamAhead bytes ahead
// into L1, as a one-row call does, and ``ahead`` bytes ahead (farther) into L2.
template <int S, int MT, typename D, typename T>
inline void row_streams(const D& d, const T* x, int64_t ldx, int64_t k, const int64_t (&n)[S],
                        float (&out)[S][MT], int64_t ahead) {
  __m512 acc[S][MT];
#pragma GCC unroll 4
  for (int i = 0; i < S; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k0 = 0;
  for (; k0 + D::kVec <= k; k0 += D::kVec) {
    typename D::X xv[MT];
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) xv[j] = D::load_x(x + j * ldx, k0);
#pragma GCC unroll 4
    for (int i = 0; i < S; ++i) {
      if (ahead > 0) {
        _mm_prefetch(static_cast<const char*>(d.at(n[i], k0)) + kStreamAhead, _MM_HINT_T0);
        _mm_prefetch(static_cast<const char*>(d.at(n[i], k0)) + ahead, _MM_HINT_T2);
      }
      const typename D::W w = d.load(n[i], k0);
#pragma GCC unroll 4
      for (int j = 0; j < MT; ++j) acc[i][j] = D::dot(acc[i][j], w, xv[j]);
    }
  }
  if (k0 < k) {
    const int64_t len = k - k0;
#pragma GCC unroll 4
    for (int i = 0; i < S; ++i) {
      const typename D::W w = d.load_tail(n[i], k0, len);
#pragma GCC unroll 4
      for (int j = 0; j < MT; ++j) acc[i][j] = D::dot(acc[i][j], w, D::load_x_tail(x + j * ldx, k0, len));
    }
  }
  // The S * MT horizontal sums together, each in _mm512_reduce_add_ps's order (sum_lanes;
  // row_streams1 sums one at a time that way).
  __m512 v[S * MT];
#pragma GCC unroll 4
  for (int i = 0; i < S; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) v[i * MT + j] = acc[i][j];
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum_lanes(v));
#pragma GCC unroll 4
  for (int i = 0; i < S; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) out[i][j] = lanes[sum_lane(i * MT + j)];
}

// Outputs ``outs`` (S far-apart ones) times every row, kMT rows at a time: the first block of
// rows streams the S weight rows from memory, the others find them in L1. The first block
// also prefetches into L2 twice kStreamAhead per block of rows ahead, so that the memory
// keeps reading the next outputs' weights while the later blocks compute from L1 (SmolLM2's
// linears, 2 threads, 2-core AMD VM: 5 rows 0.74x the time, 9 rows 0.93x; same bits;
// benchmarks/results/bench_gemv_rows_s28.json).
template <int S, typename D, typename T, typename Store>
inline void outputs_all_rows(const D& d, const T* x, int64_t m, int64_t k, const int64_t (&outs)[S],
                             Store&& store) {
  const int64_t blocks = (m + kMT - 1) / kMT;
  for (int64_t m0 = 0; m0 < m; m0 += kMT) {
    const int mt = static_cast<int>(std::min<int64_t>(kMT, m - m0));
    dispatch_rows<kMT>(mt, [&](auto MT) {
      constexpr int R = decltype(MT)::value;
      float s[S][R];
      row_streams<S, R>(d, x + m0 * k, k, k, outs, s, m0 == 0 ? 2 * kStreamAhead * blocks : 0);
      for (int j = 0; j < R; ++j)
        for (int i = 0; i < S; ++i) store(m0 + j, outs[i], 1, &s[i][j]);
    });
  }
}

// Tiles [begin, end) of kNT outputs times every row, on the calling thread;
// ``store(m, n0, nt, sums)`` writes nt results of row m.
template <typename D, typename T, typename Store>
void rows_range(const D& d, const T* x, int64_t m, int64_t n, int64_t k, int64_t begin, int64_t end,
                Store&& store) {
  // Each output on its own, two far-apart outputs at a time, so that the weight is read as
  // two address-ordered streams, every row of the call multiplied with each weight vector
  // while it is in registers (kMT rows at a time; later row blocks find the two weight rows
  // in L1). The four-output tile's four interleaved row streams read the weight at about
  // half this rate from memory on the 2-core AMD EPYC VM (benchmarks/bench_gemv_rows.py).
  const int64_t first = begin * kNT, last = std::min(n, end * kNT), half = (last - first) / 2;
  if (m == 1) {  // the decode step's common case, without the row blocks' loop
    for (int64_t i = 0; i < half; ++i) {
      const int64_t outs[2] = {first + i, first + half + i};
      float s[2];
      row_streams1<2>(d, x, k, outs, s);
      store(0, outs[0], 1, &s[0]);
      store(0, outs[1], 1, &s[1]);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const int64_t outs[2] = {first + i, first + half + i};
      outputs_all_rows<2>(d, x, m, k, outs, store);
    }
  }
  if ((last - first) % 2) {
    const int64_t outs[1] = {last - 1};
    outputs_all_rows<1>(d, x, m, k, outs, store);
  }
}

#endif  // RADIXSERVE_GEMV

}  // namespace

namespace radixserve_cpu::gemv {

#if RADIXSERVE_GEMV
void dense_rows_f32(const float* x, int64_t m, const float* w, const float* bias, int64_t n, int64_t k,
                    int64_t tile_begin, int64_t tile_end, float* out) {
  rows_range(F32{w, k}, x, m, n, k, tile_begin, tile_end, [&](int64_t r, int64_t n0, int nt, const float* s) {
    for (int i = 0; i < nt; ++i) out[r * n + n0 + i] = bias ? s[i] + bias[n0 + i] : s[i];
  });
}

void dense_rows_bf16(const uint16_t* x, int64_t m, const uint16_t* w, const float* bias, int64_t n, int64_t k,
                     int64_t tile_begin, int64_t tile_end, uint16_t* out) {
  rows_range(BF16{w, k}, x, m, n, k, tile_begin, tile_end, [&](int64_t r, int64_t n0, int nt, const float* s) {
    for (int i = 0; i < nt; ++i) out[r * n + n0 + i] = float_to_bf16(bias ? s[i] + bias[n0 + i] : s[i]);
  });
}

#else
void dense_rows_f32(const float*, int64_t, const float*, const float*, int64_t, int64_t, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
}
void dense_rows_bf16(const uint16_t*, int64_t, const uint16_t*, const float*, int64_t, int64_t, int64_t, int64_t,
                     uint16_t*) {
  TORCH_CHECK(false, "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
}
#endif  // RADIXSERVE_GEMV

}  // namespace radixserve_cpu::gemv

namespace {

using namespace radixserve_cpu::gemv;

void check_x(const at::Tensor& x, at::ScalarType dtype, int64_t k) {
  TORCH_CHECK(gemv_supported(), "radixserve_cpu gemv kernels were not built for this CPU (need AVX-512 bf16)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dtype &&
                  x.size(1) == k,
              "x must be a contiguous [M, ", k, "] ", dtype, " CPU tensor");
}

// y = x @ w.T (+ bias) for float32 or bfloat16 x and w [N, K] of the same dtype (row-major,
// read in place); y in x's dtype, each output summed in float32 and rounded once.
at::Tensor gemv_dense(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "w must be a contiguous [N, K] CPU tensor");
  const int64_t n = w.size(0), k = w.size(1), m = x.size(0);
  check_x(x, w.scalar_type(), k);
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "w must be float32 or bfloat16");
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor b;
  if (has_bias) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "bias must have N elements");
  }
  at::Tensor y = at::empty({m, n}, x.options());
#if RADIXSERVE_GEMV
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  const int64_t tiles = dense_tiles(n);
  if (w.scalar_type() == at::kFloat) {
    at::parallel_for(0, tiles, grain_for(k, 4.0), [&](int64_t begin, int64_t end) {
      dense_rows_f32(x.data_ptr<float>(), m, w.data_ptr<float>(), bp, n, k, begin, end, y.data_ptr<float>());
    });
  } else {
    at::parallel_for(0, tiles, grain_for(k, 2.0), [&](int64_t begin, int64_t end) {
      dense_rows_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m,
                      reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), bp, n, k, begin, end,
                      reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
    });
  }
#endif
  return y;
}

}  // namespace

// int8 and int4 live in gemv_int8.cpp and gemv_int4.cpp (int8 registers its own ops).
at::Tensor radixserve_gemv_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                                int64_t group_size);
at::Tensor radixserve_gemv_int4_unpack(const at::Tensor& packed, int64_t group_size);
at::Tensor radixserve_gemv_int4_dequantize(const at::Tensor& packed, const at::Tensor& scales_zeros,
                                           int64_t group_size);

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("gemv_supported() -> bool", &gemv_supported);
  m.def("gemv_dense(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("gemv_dense", c10::DispatchKey::CPU, &gemv_dense);
  m.def("gemv_int4(Tensor x, Tensor packed, Tensor scales_zeros, int group_size) -> Tensor");
  m.impl("gemv_int4", c10::DispatchKey::CPU, &radixserve_gemv_int4);
  m.def("gemv_int4_unpack(Tensor packed, int group_size) -> Tensor");
  m.impl("gemv_int4_unpack", c10::DispatchKey::CPU, &radixserve_gemv_int4_unpack);
  m.def("gemv_int4_dequantize(Tensor packed, Tensor scales_zeros, int group_size) -> Tensor");
  m.impl("gemv_int4_dequantize", c10::DispatchKey::CPU, &radixserve_gemv_int4_dequantize);
}
