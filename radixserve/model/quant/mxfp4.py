"""MXFP4 weights (the OCP microscaling format gpt-oss's experts are released in), decoded to a
float dtype at load.

Each row of a weight is cut into groups of 32 values; a group is 16 bytes of fp4 e2m1 codes
(two a byte, the low nibble first) and one e8m0 scale byte (the exponent ``scale - 127``)::

    blocks [..., G, 16] uint8  ->  values [..., G * 32]: FP4[code] * 2 ** (scale - 127)
    scales [..., G]     uint8

radixserve serves the decoded weights (bf16 or float32): no kernel here reads the codes.
Decoding goes ``rows_per_chunk`` rows at a time, so what it allocates beside its output is
bounded (index tensors of a chunk) whatever the weight's size; the loader calls it one expert
at a time, so the peak beside the loaded model is one expert's decoded weight. The values
are transformers' (``transformers.integrations.mxfp4.convert_moe_packed_tensors``), bit for
bit (see :func:`dequantize_mxfp4`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The 16 fp4 e2m1 values by code (sign bit 3): what each nibble decodes to before scaling.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
GROUP = 32  # values per scale
SCALE_BIAS = 127  # e8m0: the exponent is the byte minus this


def dequantize_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    rows_per_chunk: int = 1 << 16,
) -> torch.Tensor:
    """``blocks`` ``[..., G, 16]`` uint8 and ``scales`` ``[..., G]`` uint8 -> ``[..., G * 32]``
    in ``dtype`` (module docstring), ``rows_per_chunk`` groups decoded at a time.

    Each byte is looked up whole in a float32 table of its two values (one gather for both
    nibbles) and scaled by ``2 ** (scale - 127)`` in float32, then rounded to ``dtype`` once:
    a value of two significant bits times a power of two is exact in bf16 as in float32, so
    this is transformers' result bit for bit, in one gather where transformers' does one per
    nibble and an ``ldexp`` (several times faster on this project's 2-core CPU; no figure is
    quoted: none came from a committed benchmark)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    lead = blocks.shape[:-2]
    codes = blocks.reshape(-1, GROUP // 2)
    exps = scales.reshape(-1, 1)
    pairs = _byte_table(blocks.device)
    out = torch.empty(codes.shape[0], GROUP, dtype=dtype, device=blocks.device)
    for r0 in range(0, codes.shape[0], rows_per_chunk):
        chunk = slice(r0, r0 + rows_per_chunk)
        values = F.embedding(codes[chunk].long(), pairs).view(-1, GROUP)  # float32
        values.mul_(torch.exp2(exps[chunk].float() - SCALE_BIAS))
        out[chunk].copy_(values)
    return out.view(*lead, -1)


def _byte_table(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` float32: the two values of each byte (its low nibble first)."""
    return torch.tensor(
        [[FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]] for b in range(256)],
        dtype=torch.float32,
        device=device,
    )
