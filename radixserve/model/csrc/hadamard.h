// int4 KV rows' rotation (radixkernels/kv_format.py): the fast Walsh-Hadamard transform,
// which the store (store_kv.cpp) applies to each new row and the attention kernel
// (paged_attention_quant.h) to each query and output row.
#pragma once

#include <cmath>
#include <cstdint>

namespace radixserve_cpu {

// x <- x H for the normalized Sylvester Hadamard matrix H (d a power of two; kv_format.py's
// rotation, H[i, j] = (-1)^popcount(i & j) / sqrt(d)), in float32, by the fast transform's
// butterflies: radixkernels.reference.hadamard_rotate's additions in its order, then its one
// multiply by the float 1 / sqrt(d). So the codes stored agree with the reference's bit for
// bit, and a row's bits depend on that row alone.
//
// H is symmetric and orthonormal, so this is also x H^T = x H^-1. int4 pages hold rows k H
// and v H: a query rotated once scores q H . k H = q . k, and the probabilities' sum of rows
// v H, rotated once more, is the sum of rows v. So the kernel attends over the rotated codes
// as over any pages and rotates only each row's query (as it loads it) and output (as it
// writes it), not every key.
inline void hadamard_rotate(float* x, int64_t d) {
  for (int64_t half = 1; half < d; half *= 2) {
    for (int64_t i = 0; i < d; i += 2 * half) {
      for (int64_t j = i; j < i + half; ++j) {
        const float a = x[j], b = x[j + half];
        x[j] = a + b, x[j + half] = a - b;
      }
    }
  }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (int64_t j = 0; j < d; ++j) x[j] *= norm;
}

}  // namespace radixserve_cpu
