"""GGUF weights into radixserve's formats, without the float32 detour where the block maps.

A GGUF tensor is ``N`` rows of ``K / block`` blocks (ggml's ``ne = [K, N]``). The blocks
that are an int4 group already (``w = d * q + m`` over 32 consecutive inputs, q in 0..15)
map onto :class:`~radixserve.model.quant.formats.Int4Weight` with group 32, codes bit-exact::

    Q4_0   [d f16][16 B: q0..15 low nibbles, q16..31 high]       s = d,      z = 8 d - 8 d = 0
    Q4_1   [d f16][m f16][16 B]                                  s = d,      z = m + 8 d
    Q4_K   [d f16][dmin f16][12 B 6-bit sc/min x 8][128 B]       s = d sc_j, z = 8 s - dmin min_j  (8 groups of 32)

(scales and zeros are then rounded to the kernel's bf16). Everything else (Q8_0, whose
per-32 scales do not fit int8's per-channel scale; Q5/Q6/Q2/Q3 K-quants; F16/F32) is
dequantized with ``gguf``'s reference decoder and re-quantized, and the report says so.

llama.cpp stores Llama's q/k rows permuted for its RoPE layout; rows are whole quantization
rows, so the inverse permutation is applied to codes and scales directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from radixserve.model.quant.formats import Int4Weight

INT4_DIRECT_TYPES = ("Q4_0", "Q4_1", "Q4_K")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFTensor(NamedTuple):
    """One tensor of the file: HF name, ggml type name, logical shape ``[N, K]`` (or ``[N]``), raw data."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    raw: Any  # numpy memmap of the file's bytes for this tensor
    ggml_type: Any


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: not a model weight)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, idx, kind = base.split(".", 2)
        return f"model.layers.{idx}.{_LAYER_NAMES[kind]}.{suffix}" if kind in _LAYER_NAMES else None
    return f"{_TOP_NAMES[base]}.{suffix}" if base in _TOP_NAMES else None


class GGUFFile:
    """A GGUF file's tensors (memory-mapped) and the metadata the loader needs."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        arch = self.reader.fields["general.architecture"]
        self.architecture = bytes(arch.parts[arch.data[0]]).decode()
        self.num_heads = self._int(f"{self.architecture}.attention.head_count")
        self.num_kv_heads = (
            self._int(f"{self.architecture}.attention.head_count_kv") or self.num_heads
        )

    def _int(self, key: str) -> int | None:
        f = self.reader.fields.get(key)
        return None if f is None else int(f.parts[f.data[0]][0])

    def tensors(self) -> Iterator[GGUFTensor]:
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml ne is innermost-first
            yield GGUFTensor(name, t.tensor_type.name, shape, t.data, t.tensor_type)

    def type_counts(self) -> dict[str, int]:
        """How many 2-D weight tensors of each ggml type (what ``auto`` chooses from)."""
        counts: dict[str, int] = {}
        for t in self.tensors():
            if len(t.shape) == 2 and ".layers." in t.name:
                counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts

    def nearest_method(self) -> str | None:
        """The radixserve format nearest the file's decoder-layer weights: int4 for 4-bit
        blocks, int8 for 5- to 8-bit ones, None (full precision) for float files."""
        counts = self.type_counts()
        if not counts:
            return None
        main = max(counts, key=lambda k: counts[k])
        if main.startswith(("Q4", "IQ4", "Q3", "Q2", "IQ3", "IQ2", "IQ1", "TQ")):
            return "int4"
        if main.startswith(("Q5", "Q6", "Q8")):
            return "int8"
        return None

    def unpermute_rows(self, name: str, n: int) -> torch.Tensor | None:
        """Row order that undoes llama.cpp's q/k RoPE permutation (None where there is none)."""
        if self.architecture != "llama" or not name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            return None
        heads = self.num_heads if ".q_proj." in name else self.num_kv_heads
        assert heads is not None
        rows = torch.arange(n)
        # The file holds permute(w): rows viewed [h, 2, n/h/2] swapped to [h, n/h/2, 2]; undo that.
        return rows.view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """``gguf``'s reference decoder: float32 of the tensor's logical shape."""
    from gguf.quants import dequantize as gg_dequantize

    arr = gg_dequantize(np.asarray(t.raw), t.ggml_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).reshape(t.shape)


def _blocks(t: GGUFTensor, block_bytes: int) -> np.ndarray:
    n = t.shape[0]
    return np.asarray(t.raw, dtype=np.uint8).reshape(n, -1, block_bytes)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: low nibbles are elements 0-15, high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.float16).astype(np.float32)[..., 0]


def int4_from_blocks(t: GGUFTensor, scale_dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
    """Decode a Q4_0 / Q4_1 / Q4_K tensor into group-32 int4 with the codes unchanged.

    ``zero`` is formed against the rounded scale (``min + 8 * round(s)``) so a weight that
    was the block's minimum decodes exactly to it, as quantizing the dequantized tensor does.
    """
    n, k = t.shape
    if t.type_name == "Q4_0":
        b = _blocks(t, 18)
        d = _f16(b[..., 0:2])
        codes = _nibbles_32(b[..., 2:18])
        lo = -8.0 * d
    elif t.type_name == "Q4_1":
        b = _blocks(t, 20)
        d, lo = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        codes = _nibbles_32(b[..., 4:20])
    elif t.type_name == "Q4_K":
        from gguf.quants import Q4_K

        b = _blocks(t, 144)
        nb = b.shape[1]
        dd, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        sc = sc.reshape(n, nb, 8).astype(np.float32)
        mn = mn.reshape(n, nb, 8).astype(np.float32)
        d = (dd[..., None] * sc).reshape(n, nb * 8)
        lo = -(dmin[..., None] * mn).reshape(n, nb * 8)
        # 128 bytes = 4 chunks of 32 bytes; chunk c holds groups 2c (low nibbles) and 2c+1 (high).
        qs = b[..., 16:144].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(
            1, 1, 1, 2, 1
        )
        codes = (qs & 0x0F).reshape(n, nb * 8, 32)
    else:
        raise ValueError(f"{t.name}: {t.type_name} does not map onto int4 directly")
    d = d.reshape(n, k // 32)
    lo = lo.reshape(n, k // 32)
    scale = torch.from_numpy(np.ascontiguousarray(d)).to(scale_dtype)
    zero = (torch.from_numpy(np.ascontiguousarray(lo)) + 8.0 * scale.float()).to(scale_dtype)
    codes_t = torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k), dtype=np.uint8))
    return Int4Weight(codes_t, scale, zero, 32)


def permute_int4_rows(w: Int4Weight, rows: torch.Tensor) -> Int4Weight:
    """The same quantized weight with its rows reordered (quantization is per row)."""
    return Int4Weight(w.codes[rows], w.scale[rows], w.zero[rows], w.group_size)
