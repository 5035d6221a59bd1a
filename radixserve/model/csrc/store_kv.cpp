// Write the step's new K/V rows into the KV pool's pages (see store_kv.h).
#include "store_kv.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

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

}  // namespace

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
