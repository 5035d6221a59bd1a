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

// The same into quantized pages, as radixkernels.reference.store_kv_ref quantizes (bit for
// bit): int8 pages (kChar) get codes floor(x / s + 0.5) clamped to +-127 with s = max(absmax
// of the row, 1e-8) / 127 written to ``k_scale``/``v_scale`` ([num_pages, page_size, Hkv]);
// fp8 pages (e4m3 / e5m2) get x / scale[h] clamped to the format's range and rounded to
// nearest even, ``k_scale``/``v_scale`` being the per-head scales ([Hkv], read only); int4
// pages (kByte, [.., Hkv, D / 2]) get the Hadamard-rotated rows' nibbles, their scales
// max(absmax of the rotated row, 1e-8) / 7 written as int8's.
void store_kv_quant(const at::Tensor& k_new, const at::Tensor& v_new, const int64_t* slots, const at::Tensor& k_pages,
                    const at::Tensor& v_pages, const at::Tensor& k_scale, const at::Tensor& v_scale);

}  // namespace radixserve_cpu
