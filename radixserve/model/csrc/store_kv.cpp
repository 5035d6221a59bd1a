// Write the step's new K/V rows into the KV pool's pages (see store_kv.h).
#include "store_kv.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "hadamard.h"
#include "vec.h"

namespace radixserve_cpu {
namespace {

// Write the step's new K/V rows into the pool before attending: row i of ``k_new``/``v_new``
// ([T, Hkv, D], rows of D contiguous) goes to flat slot ``slots[i]`` (page * page_size +
// offset) of every KV head, converted to the pool's dtype. One pass instead of two
// index_copy_ calls (and their dtype copies) per layer.
template <typename Src, typename KV>
void store_rows(const at::Tensor& k_new, const at::Tensor& v_new, const int64_t* slots, const at::Tensor& k_pages,
                const at::Tensor& v_pages) {
  const int64_t rows = k_new.size(0), heads = k_new.size(1), d = k_new.size(2);
  const Src* ks = k_new.data_ptr<Src>();
  const Src* vs = v_new.data_ptr<Src>();
  KV* kd = k_pages.data_ptr<KV>();
  KV* vd = v_pages.data_ptr<KV>();
  const int64_t k0 = k_new.stride(0), k1 = k_new.stride(1), v0 = v_new.stride(0), v1 = v_new.stride(1);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / (heads * d)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      KV* kdst = kd + slots[r] * heads * d;
      KV* vdst = vd + slots[r] * heads * d;
      for (int64_t h = 0; h < heads; ++h) {
        const Src* kr = ks + r * k0 + h * k1;
        const Src* vr = vs + r * v0 + h * v1;
        for (int64_t j = 0; j < d; ++j) {
          kdst[h * d + j] = from_float<KV>(to_float(kr[j]));
          vdst[h * d + j] = from_float<KV>(to_float(vr[j]));
        }
      }
    }
  });
}

template <typename Src>
void store_as(const at::Tensor& k_new, const at::Tensor& v_new, const int64_t* slots, const at::Tensor& k_pages,
              const at::Tensor& v_pages) {
  switch (k_pages.scalar_type()) {
    case at::kFloat: return store_rows<Src, float>(k_new, v_new, slots, k_pages, v_pages);
    case at::kBFloat16: return store_rows<Src, c10::BFloat16>(k_new, v_new, slots, k_pages, v_pages);
    case at::kHalf: return store_rows<Src, c10::Half>(k_new, v_new, slots, k_pages, v_pages);
    default: TORCH_CHECK(false, "unsupported KV dtype ", k_pages.scalar_type());
  }
}

// One row of d values into int8 codes and its scale (quantize_int8 of the reference).
template <typename Src>
void int8_row(const Src* x, int64_t d, int8_t* codes, float* scale) {
  float absmax = 0.0f;
  for (int64_t j = 0; j < d; ++j) absmax = std::max(absmax, std::fabs(to_float(x[j])));
  const float s = std::max(absmax, 1e-8f) / 127.0f;
  *scale = s;
  for (int64_t j = 0; j < d; ++j) {
    const float y = std::floor(to_float(x[j]) / s + 0.5f);
    codes[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, y)));
  }
}

// One row of d values into fp8 codes of x / s (quantize_fp8 of the reference).
template <typename F8, typename Src>
void fp8_row(const Src* x, int64_t d, float s, float fmax, uint8_t* codes) {
  for (int64_t j = 0; j < d; ++j) {
    const float y = std::min(fmax, std::max(-fmax, to_float(x[j]) / s));
    codes[j] = F8(y).x;
  }
}

// One row of d values into int4 codes and its scale (quantize_int4 of the reference): the
// row rotated (hadamard_rotate, as the reference's), then s = max(absmax, 1e-8) / 7 and
// q = floor(r / s + 0.5) clamped to +-7, stored q + 8, element 2i in the low nibble of byte i
// and 2i + 1 in its high one.
template <typename Src>
void int4_row(const Src* x, int64_t d, uint8_t* codes, float* scale) {
  float r[256];  // the largest head size the kernel serves
  for (int64_t j = 0; j < d; ++j) r[j] = to_float(x[j]);
  hadamard_rotate(r, d);
  float absmax = 0.0f;
  for (int64_t j = 0; j < d; ++j) absmax = std::max(absmax, std::fabs(r[j]));
  const float s = std::max(absmax, 1e-8f) / 7.0f;
  *scale = s;
  auto code = [&](float v) { return static_cast<int>(std::min(7.0f, std::max(-7.0f, std::floor(v / s + 0.5f)))) + 8; };
  for (int64_t j = 0; j < d; j += 2) codes[j / 2] = static_cast<uint8_t>(code(r[j]) | (code(r[j + 1]) << 4));
}

template <typename Src>
void store_quant_rows(const at::Tensor& k_new, const at::Tensor& v_new, const int64_t* slots, const at::Tensor& k_pages,
                      const at::Tensor& v_pages, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  const int64_t rows = k_new.size(0), heads = k_new.size(1), d = k_new.size(2);
  const auto type = k_pages.scalar_type();
  const int64_t row_bytes = type == at::kByte ? d / 2 : d;  // int4: two codes a byte
  struct Side {
    const Src* src;
    int64_t s0, s1;
    uint8_t* codes;
    float* scale;
  };
  const Side sides[2] = {
      {k_new.data_ptr<Src>(), k_new.stride(0), k_new.stride(1), static_cast<uint8_t*>(k_pages.data_ptr()),
       k_scale.data_ptr<float>()},
      {v_new.data_ptr<Src>(), v_new.stride(0), v_new.stride(1), static_cast<uint8_t*>(v_pages.data_ptr()),
       v_scale.data_ptr<float>()}};
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / (heads * d)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (const Side& side : sides) {
        for (int64_t h = 0; h < heads; ++h) {
          const Src* x = side.src + r * side.s0 + h * side.s1;
          const int64_t slot = slots[r] * heads + h;
          uint8_t* codes = side.codes + slot * row_bytes;
          if (type == at::kChar) {
            int8_row(x, d, reinterpret_cast<int8_t*>(codes), side.scale + slot);
          } else if (type == at::kByte) {
            int4_row(x, d, codes, side.scale + slot);
          } else if (type == at::kFloat8_e4m3fn) {
            fp8_row<c10::Float8_e4m3fn>(x, d, side.scale[h], 448.0f, codes);
          } else {
            fp8_row<c10::Float8_e5m2>(x, d, side.scale[h], 57344.0f, codes);
          }
        }
      }
    }
  });
}

}  // namespace

void store_kv_quant(const at::Tensor& k_new, const at::Tensor& v_new, const int64_t* slots, const at::Tensor& k_pages,
                    const at::Tensor& v_pages, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  switch (k_new.scalar_type()) {
    case at::kFloat: return store_quant_rows<float>(k_new, v_new, slots, k_pages, v_pages, k_scale, v_scale);
    case at::kBFloat16:
      return store_quant_rows<c10::BFloat16>(k_new, v_new, slots, k_pages, v_pages, k_scale, v_scale);
    case at::kHalf: return store_quant_rows<c10::Half>(k_new, v_new, slots, k_pages, v_pages, k_scale, v_scale);
    default: TORCH_CHECK(false, "unsupported K/V dtype ", k_new.scalar_type());
  }
}

void store_kv(const at::Tensor& k_new, const at::Tensor& v_new, const int64_t* slots, const at::Tensor& k_pages,
              const at::Tensor& v_pages) {
  switch (k_new.scalar_type()) {
    case at::kFloat: return store_as<float>(k_new, v_new, slots, k_pages, v_pages);
    case at::kBFloat16: return store_as<c10::BFloat16>(k_new, v_new, slots, k_pages, v_pages);
    case at::kHalf: return store_as<c10::Half>(k_new, v_new, slots, k_pages, v_pages);
    default: TORCH_CHECK(false, "unsupported K/V dtype ", k_new.scalar_type());
  }
}

}  // namespace radixserve_cpu
