// Paged decode attention for the CPU: one new query row per sequence, keys and values read
// from the KV pool's pages in place, sequences that share leading pages attending to them
// together (cascade attention in one pass).
//
// Why a kernel: in plain torch a decode step's attention is ~50 small ATen calls per layer
// (page gathers, padding masks, a flash call per part, the LSE merge) whose fixed costs,
// not the arithmetic, were most of attention's time on a 2-core CPU. Here each layer is one
// call, and what is left is mostly reading the pages from memory.
//
// Work item = (group, kv head). A group is sequences whose first pages are the same pages
// (a cached system prompt); a sequence sharing nothing is a group of one with no shared
// pages. The item's query rows are every member's query heads of that KV head
// (GQA/MQA: heads h*grp .. h*grp+grp-1 read KV head h), so
//
//   1. the shared pages are read once for all rows: scores are a [rows x D] x [D x keys]
//      product per block of keys, an online softmax (FlashAttention) keeps per row the
//      running max m, the sum l and the unnormalised output acc;
//   2. each member then goes on over its own pages with its own rows, from that state;
//   3. out = acc / l.
//
// Softmax runs in base 2 (queries pre-scaled by sm_scale * log2 e) with a polynomial exp2
// that the compiler vectorises; no masking is needed because only real keys are visited.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // keys per online-softmax block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNoMax = -1e30f;  // finite "minus infinity": keeps exp2 arithmetic NaN-free

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of a float32: a shift, which vectorises (the c10 conversion may not).
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// Query rows ride in the lanes of a vector (GCC vector extensions: AVX-512 registers where
// the CPU has them, two AVX2 or four SSE registers otherwise). Scores of all rows against
// one key are then D broadcast-FMAs, with no transposition of the keys and no horizontal
// sums; the online-softmax statistics m and l are vectors too.
constexpr int64_t kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf load_vf(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store_vf(float* p, vf x) { std::memcpy(p, &x, sizeof x); }

// 2^x for x <= 0, per lane: x = n + f with n integer, |f| <= 1/2; 2^f by Cephes' exp2f
// polynomial (relative error ~2e-7), 2^n by writing the exponent bits. Below -126 it
// returns 2^-126, which is 0 for every purpose here (the weights it scales are negligible).
inline vf exp2_neg(vf x) {
  x = vmax(x, splat(-126.0f));
  const vf round = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf n = (x + round) - round;
  const vf f = x - n;
  vf p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * (vf)bits;  // a vector cast reinterprets the bits
}

// Per-thread scratch for one work item: its rows' pre-scaled queries and softmax state,
// and staging for blocks of half-precision keys/values converted to float.
struct Scratch {
  std::vector<float> q, m, l, acc, kf, vf_;
  void reserve(int64_t rows, int64_t d) {
    q.resize(rows * d);
    m.resize(rows);
    l.resize(rows);
    acc.resize(rows * d);
    kf.resize(kBlock * d);
    vf_.resize(kBlock * d);
  }
};

// Where a run of keys lives: pages in order, the run's first ``len`` tokens of them.
struct KeyRun {
  const int64_t* pages;
  int64_t len;
};

template <typename KV>
struct Layer {
  const KV* k;
  const KV* v;
  int64_t page_size, kv_heads, d;
  // Offset of token ``t`` of ``page`` for KV head ``h``, in elements.
  int64_t at(int64_t page, int64_t t, int64_t h) const { return ((page * page_size + t) * kv_heads + h) * d; }
};

// Rows of one block of keys: float pages are read in place, others converted into ``buf``.
template <typename KV>
const float* block_rows(const KV* const* src, int64_t n, int64_t d, float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < d; ++j) buf[t * d + j] = to_float(src[t][j]);
  }
  return buf;
}

// acc rows ``r``.. (``R`` of them) = acc * alpha + sum_t p[t][r] * v[t]: NC vectors of columns
// per row, R rows together, so R * NC independent FMA chains hide the FMA latency.
template <int NC, int R>
inline void accumulate_pv(float* __restrict acc, int64_t r, const vf alpha, const vf* p, const float* const* vr,
                          int64_t n) {
  constexpr int64_t d = NC * kLanes;
  vf x[R][NC];
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < NC; ++c) x[i][c] = load_vf(acc + (r + i) * d + c * kLanes) * alpha[r + i];
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int c = 0; c < NC; ++c) {
      const vf v = load_vf(vr[t] + c * kLanes);
      for (int i = 0; i < R; ++i) x[i][c] += p[t][r + i] * v;
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int c = 0; c < NC; ++c) store_vf(acc + (r + i) * d + c * kLanes, x[i][c]);
  }
}

// Attend ``rows`` query rows (``q``: [rows, d], pre-scaled, base 2) over the keys of ``run``,
// updating the online-softmax state rows ``m``, ``l``, ``acc``; ``kLanes`` rows at a time.
// ``NC``: head_dim / kLanes, fixed at compile time so the inner loops unroll into registers.
template <int NC, typename KV>
void attend_run(const Layer<KV>& L, int64_t h, KeyRun run, const float* __restrict q, int64_t rows,
                float* __restrict m, float* __restrict l, float* __restrict acc, Scratch& sc) {
  constexpr int64_t d = NC * kLanes;
  const KV* krow[kBlock];
  const KV* vrow[kBlock];
  const float* kr[kBlock];
  const float* vr[kBlock];
  vf qt[d];           // queries transposed: qt[j] lane r = q[r][j]
  vf p[kBlock];       // scores, then probabilities: p[t] lane r
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    const int64_t lanes = std::min(kLanes, rows - r0);
    for (int64_t j = 0; j < d; ++j) {
      float col[kLanes] = {};
      for (int64_t r = 0; r < lanes; ++r) col[r] = q[(r0 + r) * d + j];
      qt[j] = load_vf(col);
    }
    float mv[kLanes], lv[kLanes];
    for (int64_t r = 0; r < kLanes; ++r) {
      mv[r] = r < lanes ? m[r0 + r] : kNoMax;
      lv[r] = r < lanes ? l[r0 + r] : 0.0f;
    }
    vf vm = load_vf(mv), vl = load_vf(lv);
    for (int64_t start = 0; start < run.len; start += kBlock) {
      const int64_t n = std::min(kBlock, run.len - start);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
        const int64_t off = L.at(run.pages[pos / L.page_size], pos % L.page_size, h);
        krow[t] = L.k + off;
        vrow[t] = L.v + off;
      }
      if constexpr (std::is_same_v<KV, float>) {
        std::copy(krow, krow + n, kr);
        std::copy(vrow, vrow + n, vr);
      } else {
        const float* kb = block_rows(krow, n, d, sc.kf.data());
        const float* vb = block_rows(vrow, n, d, sc.vf_.data());
        for (int64_t t = 0; t < n; ++t) {
          kr[t] = kb + t * d;
          vr[t] = vb + t * d;
        }
      }
      // Scores, eight keys at a time: eight independent FMA chains.
      int64_t t = 0;
      for (; t + 8 <= n; t += 8) {
        vf a[8] = {};
        for (int64_t j = 0; j < d; ++j) {
          for (int u = 0; u < 8; ++u) a[u] += qt[j] * kr[t + u][j];
        }
        for (int u = 0; u < 8; ++u) p[t + u] = a[u];
      }
      for (; t < n; ++t) {
        vf a{};
        for (int64_t j = 0; j < d; ++j) a += qt[j] * kr[t][j];
        p[t] = a;
      }
      vf mx = vm;
      for (t = 0; t < n; ++t) mx = vmax(mx, p[t]);
      const vf alpha = exp2_neg(vm - mx);
      vf sum{};
      for (t = 0; t < n; ++t) {
        p[t] = exp2_neg(p[t] - mx);
        sum += p[t];
      }
      vm = mx;
      vl = vl * alpha + sum;
      float* acc0 = acc + r0 * d;
      int64_t r = 0;
      if constexpr (NC <= 8) {
        for (; r + 2 <= lanes; r += 2) accumulate_pv<NC, 2>(acc0, r, alpha, p, vr, n);
      }
      for (; r < lanes; ++r) accumulate_pv<NC, 1>(acc0, r, alpha, p, vr, n);
    }
    for (int64_t r = 0; r < lanes; ++r) {
      m[r0 + r] = vm[r];
      l[r0 + r] = vl[r];
    }
  }
}

template <typename KV>
using AttendFn = void (*)(const Layer<KV>&, int64_t, KeyRun, const float*, int64_t, float*, float*, float*, Scratch&);

// The head sizes of the models served (16 .. 256; 16 for the tests' tiny models), each its own unrolled instance.
template <typename KV>
AttendFn<KV> attend_fn(int64_t d) {
  switch (d) {
    case 16: return attend_run<1, KV>;
    case 32: return attend_run<2, KV>;
    case 64: return attend_run<4, KV>;
    case 80: return attend_run<5, KV>;
    case 96: return attend_run<6, KV>;
    case 128: return attend_run<8, KV>;
    case 256: return attend_run<16, KV>;
    default: return nullptr;
  }
}

template <typename Q, typename KV>
void run_kernel(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, at::Tensor& out,
                const at::Tensor& members, const at::Tensor& group_start, const at::Tensor& shared_pages,
                const at::Tensor& shared_start, const at::Tensor& own_pages, const at::Tensor& own_start,
                const at::Tensor& own_len, double sm_scale) {
  const int64_t hq = q.size(1), d = q.size(2);
  const Layer<KV> L{k_pages.data_ptr<KV>(), v_pages.data_ptr<KV>(), k_pages.size(1), k_pages.size(2), d};
  const int64_t grp = hq / L.kv_heads;
  const int64_t groups = group_start.size(0) - 1;
  const Q* qd = q.data_ptr<Q>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);  // q may be a view of the fused qkv projection
  Q* od = out.data_ptr<Q>();
  const int64_t* mem = members.data_ptr<int64_t>();
  const int64_t* gs = group_start.data_ptr<int64_t>();
  const int64_t* sp = shared_pages.data_ptr<int64_t>();
  const int64_t* ss = shared_start.data_ptr<int64_t>();
  const int64_t* op = own_pages.data_ptr<int64_t>();
  const int64_t* os = own_start.data_ptr<int64_t>();
  const int64_t* ol = own_len.data_ptr<int64_t>();
  const float scale = static_cast<float>(sm_scale) * kLog2e;
  const auto attend = attend_fn<KV>(d);

  at::parallel_for(0, groups * L.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / L.kv_heads, h = item % L.kv_heads;
      const int64_t first = gs[g], nm = gs[g + 1] - first, rows = nm * grp;
      sc.reserve(rows, d);
      float* qf = sc.q.data();
      for (int64_t i = 0; i < nm; ++i) {
        for (int64_t r = 0; r < grp; ++r) {
          const Q* src = qd + mem[first + i] * q_row + (h * grp + r) * q_head;
          for (int64_t j = 0; j < d; ++j) qf[(i * grp + r) * d + j] = to_float(src[j]) * scale;
        }
      }
      std::fill(sc.m.begin(), sc.m.begin() + rows, kNoMax);
      std::fill(sc.l.begin(), sc.l.begin() + rows, 0.0f);
      std::fill(sc.acc.begin(), sc.acc.begin() + rows * d, 0.0f);
      const int64_t shared_len = (ss[g + 1] - ss[g]) * L.page_size;
      if (shared_len > 0) {
        attend(L, h, KeyRun{sp + ss[g], shared_len}, qf, rows, sc.m.data(), sc.l.data(), sc.acc.data(), sc);
      }
      for (int64_t i = 0; i < nm; ++i) {
        const int64_t mi = first + i, r0 = i * grp;
        attend(L, h, KeyRun{op + os[mi], ol[mi]}, qf + r0 * d, grp, sc.m.data() + r0, sc.l.data() + r0,
                   sc.acc.data() + r0 * d, sc);
        Q* dst = od + (mem[mi] * hq + h * grp) * d;
        for (int64_t r = 0; r < grp; ++r) {
          const float inv = 1.0f / sc.l[r0 + r];
          const float* ar = sc.acc.data() + (r0 + r) * d;
          for (int64_t j = 0; j < d; ++j) dst[r * d + j] = from_float<Q>(ar[j] * inv);
        }
      }
    }
  });
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous 1-D int64 CPU tensor");
}

// out[members[i]] = attention of q[members[i]] over (its group's shared pages, then its own).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                            at::Tensor out, const at::Tensor& members, const at::Tensor& group_start,
                            const at::Tensor& shared_pages, const at::Tensor& shared_start,
                            const at::Tensor& own_pages, const at::Tensor& own_start, const at::Tensor& own_len,
                            double sm_scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.device().is_cpu(),
              "q must be a [T, Hq, D] CPU tensor with contiguous rows of D");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "out must be a contiguous tensor like q");
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.is_contiguous() && v_pages.sizes() == k_pages.sizes() &&
                  v_pages.scalar_type() == k_pages.scalar_type() && v_pages.is_contiguous(),
              "k_pages and v_pages must be contiguous [num_pages, page_size, Hkv, D] tensors of one dtype");
  TORCH_CHECK(k_pages.size(3) == q.size(2), "head_dim of q and the pages differ");
  TORCH_CHECK(attend_fn<float>(q.size(2)) != nullptr, "head_dim must be one of 16, 32, 64, 80, 96, 128, 256, got ",
              q.size(2));
  TORCH_CHECK(q.size(1) % k_pages.size(2) == 0, "query heads must be a multiple of KV heads");
  for (auto [t, name] : {std::pair{&members, "members"}, {&group_start, "group_start"},
                         {&shared_pages, "shared_pages"}, {&shared_start, "shared_start"},
                         {&own_pages, "own_pages"}, {&own_start, "own_start"}, {&own_len, "own_len"}}) {
    check_index(*t, name);
  }
  TORCH_CHECK(shared_start.size(0) == group_start.size(0), "shared_start needs one entry per group, plus one");
  TORCH_CHECK(own_start.size(0) == members.size(0) + 1 && own_len.size(0) == members.size(0),
              "own_start/own_len need one entry per member (plus one)");

#define RADIX_DISPATCH_KV(QT)                                                                              \
  switch (k_pages.scalar_type()) {                                                                         \
    case at::kFloat: return run_kernel<QT, float>(q, k_pages, v_pages, out, members, group_start,           \
                                                  shared_pages, shared_start, own_pages, own_start,        \
                                                  own_len, sm_scale);                                      \
    case at::kBFloat16: return run_kernel<QT, c10::BFloat16>(q, k_pages, v_pages, out, members,             \
                                                             group_start, shared_pages, shared_start,      \
                                                             own_pages, own_start, own_len, sm_scale);     \
    case at::kHalf: return run_kernel<QT, c10::Half>(q, k_pages, v_pages, out, members, group_start,        \
                                                     shared_pages, shared_start, own_pages, own_start,     \
                                                     own_len, sm_scale);                                   \
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

}  // namespace

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor(a!) out, Tensor members, "
      "Tensor group_start, Tensor shared_pages, Tensor shared_start, Tensor own_pages, Tensor own_start, "
      "Tensor own_len, float sm_scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
