// Fused elementwise ops of the Llama layer for the CPU: RoPE in place, SiLU(gate) * up, and
// RMSNorm with the residual add before it.
//
// In torch each is several passes over the activations (RoPE: two products, a negation, a
// concatenation, a sum; the MLP: silu, then a product over strided halves; RMSNorm: pow,
// mean, rsqrt, two products, dtype copies, and the residual add) plus a temporary per pass;
// here each is one pass, computed in float32 and rounded once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "vec.h"

namespace {

using namespace radixserve_cpu;

// x[t, h, :] rotated by the angles of row t (transformers' rotate_half convention):
// first half  x1 * cos - x2 * sin,  second half  x2 * cos + x1 * sin.
template <typename T>
void rotary_kernel(at::Tensor& x, const float* cos, const float* sin) {
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* base = x.data_ptr<T>();
  // Grain: at decode sizes (a few rows) one thread; a wake-up costs more than the work.
  at::parallel_for(0, rows * heads, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      T* p = base + t * s0 + h * s1;
      const float* c = cos + t * d;
      const float* s = sin + t * d;
      int64_t j = 0;
      for (; j + kLanes <= half; j += kLanes) {
        const vf x1 = load_as_vf(p + j), x2 = load_as_vf(p + j + half);
        store_from_vf(p + j, x1 * load_vf(c + j) - x2 * load_vf(s + j));
        store_from_vf(p + j + half, x2 * load_vf(c + j + half) + x1 * load_vf(s + j + half));
      }
      for (; j < half; ++j) {
        const float x1 = to_float(p[j]), x2 = to_float(p[j + half]);
        p[j] = from_float<T>(x1 * c[j] - x2 * s[j]);
        p[j + half] = from_float<T>(x2 * c[j + half] + x1 * s[j + half]);
      }
    }
  });
}

// RoPE in place on ``x`` [T, heads, D] (rows of D contiguous, e.g. the q and k heads of the
// fused qkv projection) with float32 ``cos``/``sin`` [T, D] of each row's position.
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.device().is_cpu() && x.size(2) % 2 == 0,
              "x must be a [T, heads, D] CPU tensor with contiguous rows of even D");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == x.size(0) * x.size(2),
                "cos and sin must be contiguous float32 [T, D] tensors");
  }
  switch (x.scalar_type()) {
    case at::kFloat: return rotary_kernel<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>());
    case at::kBFloat16: return rotary_kernel<c10::BFloat16>(x, cos.data_ptr<float>(), sin.data_ptr<float>());
    case at::kHalf: return rotary_kernel<c10::Half>(x, cos.data_ptr<float>(), sin.data_ptr<float>());
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

template <typename T>
void silu_mul_kernel(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), n = out.size(1);
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * 2 * n;
      const T* u = g + n;
      T* dst = o + r * n;
      int64_t j = 0;
      for (; j + kLanes <= n; j += kLanes) {
        const vf x = load_as_vf(g + j);
        store_from_vf(dst + j, x / (1.0f + exp2v(x * -kLog2e)) * load_as_vf(u + j));
      }
      for (; j < n; ++j) {
        const float x = to_float(g[j]);
        dst[j] = from_float<T>(x / (1.0f + std::exp(-x)) * to_float(u[j]));
      }
    }
  });
}

// out = silu(gate) * up for ``gate_up`` [T, 2n] (gate the first n columns), out [T, n].
void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.device().is_cpu() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2n] CPU tensor");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == gate_up.scalar_type() && out.dim() == 2 &&
                  out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1),
              "out must be a contiguous [T, n] tensor of gate_up's dtype");
  switch (gate_up.scalar_type()) {
    case at::kFloat: return silu_mul_kernel<float>(gate_up, out);
    case at::kBFloat16: return silu_mul_kernel<c10::BFloat16>(gate_up, out);
    case at::kHalf: return silu_mul_kernel<c10::Half>(gate_up, out);
    default: TORCH_CHECK(false, "unsupported dtype ", gate_up.scalar_type());
  }
}

// One row of RMSNorm: with a residual, residual = round(residual + x) first (the sum rounded
// to the storage dtype, as transformers' residual stream is) and that is normalised; then
// out = round(w * (v / sqrt(mean(v^2) + eps))), float32 inside.
template <typename T>
inline void rms_norm_row(const T* x, T* res, const T* w, T* out, int64_t n, float eps) {
  const T* src = x;
  if (res != nullptr) {
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) store_from_vf(res + j, load_as_vf(res + j) + load_as_vf(x + j));
    for (; j < n; ++j) res[j] = from_float<T>(to_float(res[j]) + to_float(x[j]));
    src = res;
  }
  // Four vectors of partial sums: independent add chains, and a sum order close to torch's
  // pairwise one over long rows.
  vf acc[4] = {};
  int64_t j = 0;
  for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
    for (int u = 0; u < 4; ++u) {
      const vf v = load_as_vf(src + j + u * kLanes);
      acc[u] += v * v;
    }
  }
  for (; j + kLanes <= n; j += kLanes) {
    const vf v = load_as_vf(src + j);
    acc[0] += v * v;
  }
  const vf tot = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float ss = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) ss += tot[i];
  for (; j < n; ++j) ss += to_float(src[j]) * to_float(src[j]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  j = 0;
  for (; j + kLanes <= n; j += kLanes) store_from_vf(out + j, load_as_vf(w + j) * (load_as_vf(src + j) * inv));
  for (; j < n; ++j) out[j] = from_float<T>(to_float(w[j]) * (to_float(src[j]) * inv));
}

template <typename T>
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, double eps, T* res, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* in = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  // Grain: decode batches (tens of rows) stay on the calling thread.
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_row<T>(in + r * n, res == nullptr ? nullptr : res + r * n, w, o + r * n, n, static_cast<float>(eps));
    }
  });
}

// out = RMSNorm(x) * weight for ``x`` [T, n]; with ``residual`` (like x), first residual += x
// in place and out = RMSNorm(residual) * weight.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, std::optional<at::Tensor> residual,
              at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous [T, n] CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [n] tensor of x's dtype");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "out must be a contiguous tensor like x");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must be a contiguous tensor like x");
  }
  switch (x.scalar_type()) {
#define RADIX_NORM_CASE(ST, T)                                                                               \
  case ST:                                                                                                   \
    return rms_norm_kernel<T>(x, weight, eps, residual.has_value() ? residual->data_ptr<T>() : nullptr, out);
    RADIX_NORM_CASE(at::kFloat, float)
    RADIX_NORM_CASE(at::kBFloat16, c10::BFloat16)
    RADIX_NORM_CASE(at::kHalf, c10::Half)
#undef RADIX_NORM_CASE
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, &rotary_);
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual, Tensor(b!) out) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
}
