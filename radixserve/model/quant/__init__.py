"""Weight quantization: int8 / int4 weight-only and fp8 linears, from checkpoints and GGUF files.

- :mod:`.formats`: the formats and their plain-torch quantize/dequantize references.
- :mod:`.linear`: the layers, over torch's packed weight-only kernels and ``_scaled_mm``.
- :mod:`.config`: ``--quantization`` and its options, checked against the device.
- :mod:`.apply`: quantize a loaded model in place; :class:`QuantReport` says what was done.
- :mod:`.gguf_weights` / :mod:`.gguf_loader`: GGUF blocks into these formats.
"""

from __future__ import annotations

from radixserve.model.quant.apply import (
    QuantReport,
    quantize_model,
    set_dense_min_rows,
    set_reference_mode,
)
from radixserve.model.quant.config import QUANT_METHODS, QuantConfig, check_device

__all__ = [
    "QUANT_METHODS",
    "QuantConfig",
    "QuantReport",
    "check_device",
    "quantize_model",
    "set_dense_min_rows",
    "set_reference_mode",
]
