"""Weight quantization: int8 / int4 weight-only and fp8 linears, from checkpoints and GGUF files.

- :mod:`.formats`: the formats and their plain-torch quantize/dequantize references.
- :mod:`.linear`: the layers, over torch's packed weight-only kernels and ``_scaled_mm``.
- :mod:`.config`: ``--quantization`` and its options, checked against the device.
- :mod:`.apply`: make, install and count quantized layers; :class:`QuantReport` says what was done.
- :mod:`.gguf_weights`: GGUF blocks into these formats.
- :mod:`.mxfp4`: MXFP4 weights (gpt-oss's experts) decoded to a float dtype at load.

This package stands under the model (the decoder layers use its linears) and imports nothing
of it above ``cpu_linear`` / ``cpu_gemv``. What walks a built model stands above it, beside the
loader: :mod:`radixserve.model.quantize` (quantize a loaded model) and
:mod:`radixserve.model.gguf_loader` (build one from a GGUF file).
"""

from __future__ import annotations

from radixserve.model.quant.apply import (
    QuantReport,
    set_dense_min_rows,
    set_reference_mode,
)
from radixserve.model.quant.config import QUANT_METHODS, QuantConfig, check_device

__all__ = [
    "QUANT_METHODS",
    "QuantConfig",
    "QuantReport",
    "check_device",
    "set_dense_min_rows",
    "set_reference_mode",
]
