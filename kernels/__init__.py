"""radixkernels: Triton kernels for radixserve, each with a plain-torch reference.

Installed under the import name ``radixkernels`` (the bare name ``kernels`` belongs to an
unrelated package on PyPI). Only torch and triton may be imported here.

- :mod:`radixkernels.reference`: plain-torch semantics (``store_kv_ref``, ``dequantize_ref``,
  ``paged_attention_ref``, ``paged_decode_attention_ref``, ``extend_attention_ref``, quantize math).
- Triton kernels with the same signatures: ``store_kv``, ``paged_decode_attention``,
  ``extend_attention``; fused layer ops ``rms_norm`` (+ residual add), ``silu_mul``,
  ``rope_store_kv`` (references in :mod:`radixkernels.fused_reference`); ``int8_linear``
  (int8 weight-only GEMV, :mod:`radixkernels.int8_gemv`).
  They are imported lazily (on first attribute access) so that the
  torch-only paths never import triton, and so that ``TRITON_INTERPRET`` is read when the
  kernels are defined, not when this package is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixkernels.kv_format import KVCacheDtype, KVFormat

_LAZY = {
    "store_kv": "radixkernels.kv_store",
    "paged_decode_attention": "radixkernels.decode",
    "extend_attention": "radixkernels.extend",
    "rms_norm": "radixkernels.fused",
    "silu_mul": "radixkernels.fused",
    "rope_store_kv": "radixkernels.fused",
    "int8_linear": "radixkernels.int8_gemv",
}

__all__ = ["KVCacheDtype", "KVFormat", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'radixkernels' has no attribute {name!r}")
