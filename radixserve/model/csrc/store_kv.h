// Writing a step's new K/V rows into the KV pool's pages (store_kv.cpp): the paged-attention
// kernel's first step when it is given the new rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace radixserve_cpu {

// Row i of ``k_new``/``v_new`` ([T, Hkv, D], rows of D contiguous, one dtype) into flat slot
// ``slots[i]`` of ``k_pages``/``v_pages`` (checked by the caller), converted to their dtype.
void store_kv(const at::Tensor& k_new, const at::Tensor& v_new, const int64_t* slots, const at::Tensor& k_pages,
              const at::Tensor& v_pages);

}  // namespace radixserve_cpu
