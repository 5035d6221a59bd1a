"""radixkernels: Triton kernels for radixserve, each with a plain-torch reference.

Installed under the import name ``radixkernels`` (the bare name ``kernels`` belongs to an
unrelated package on PyPI). Only torch and triton may be imported here.
"""

from __future__ import annotations

from radixkernels.kv_format import KVCacheDtype, KVFormat

__all__ = ["KVCacheDtype", "KVFormat"]
