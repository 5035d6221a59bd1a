"""When the model's layers use the fused Triton kernels (:mod:`radixkernels.fused`): on CUDA.

The CPU keeps its C++ kernels (:mod:`radixserve.model.native`); on a CUDA tensor the layers
call RMSNorm (+ residual add), SiLU * up and, with the Triton attention backend on an
unquantized pool, RoPE fused with the KV store. ``RADIXSERVE_TRITON_OPS=0`` turns them off
(the torch ops serve instead). Tests run the same path on the CPU, under the Triton
interpreter, with :func:`forced`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

_forced: bool | None = None


def enabled(x: torch.Tensor) -> bool:
    """Whether the layers route ``x`` through the fused Triton kernels."""
    if _forced is not None:
        return _forced
    return x.is_cuda and os.environ.get("RADIXSERVE_TRITON_OPS", "1") != "0"


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """Force the fused path on or off whatever the device (tests: on the CPU, interpreted)."""
    global _forced
    saved, _forced = _forced, on
    try:
        yield
    finally:
        _forced = saved
