"""Rotary position embedding: the inverse frequencies of every RoPE scaling type a supported
checkpoint uses, computed as transformers' ``modeling_rope_utils`` computes them, and the
cos/sin table every layer of a forward shares.

``yarn`` and ``longrope`` also scale cos and sin by an attention factor (folded into the
table, so the kernels that rotate need not know). ``longrope`` has two sets of factors:
transformers picks the long ones for the *whole* forward once any position passes the
original context. A KV cache cannot re-rotate keys it already stored, so here each
position uses the factors of its own range (short below ``original_max_position_embeddings``,
long from there on): identical to transformers for sequences within the original context,
and the only choice under which a cached prefix's keys stay valid beyond it (vLLM and SGLang
switch per batch instead, which a prefix cache cannot honour either).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixserve.model.config import RopeScaling


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor ``yarn`` and ``longrope`` multiply cos and sin by (1.0 for the others)."""
    if scaling is None or scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
    return mscale(factor)


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        orig = s.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate (slowed by factor)
    return interpolation * (1 - keep) + extrapolation * keep


def rope_inv_freq(
    dim: int, theta: float, scaling: RopeScaling | None, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies ``[dim // 2]`` (float32, CPU) for the config's RoPE type; ``dim``
    is the rotated part of a head (``head_dim`` unless the family rotates only a fraction).
    ``long``: longrope's long factors instead of its short ones."""
    # On the CPU even while the model is built on ``meta`` (the loader's default device).
    with torch.device("cpu"):
        return _inv_freq(dim, theta, scaling, long)


def _inv_freq(dim: int, theta: float, scaling: RopeScaling | None, long: bool) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if scaling is not None and scaling.rope_type == "longrope":
        ext = torch.tensor(scaling.long_factor if long else scaling.short_factor)
        return 1.0 / (ext.float() * theta**exponents)
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by ``factor``, short ones kept, a smooth ramp between.
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {scaling.rope_type!r}")


class RotaryEmbedding(nn.Module):
    """A cos/sin table ``[positions, rotary_dim]`` indexed by each row's position.

    The table grows on demand (doubling), sized from the batch's host-side sequence lengths,
    so a forward never syncs the device to learn the largest position.
    """

    # Tensors built from the configuration alone, on demand: new weights keep them
    # (model/weight_update.py).
    CONFIG_CACHES = ("_cos", "_sin")

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.scaling = scaling
        # Plain attributes: they stay out of state_dict.
        self.inv_freq = rope_inv_freq(self.rotary_dim, theta, scaling)
        self.long_inv_freq = (
            rope_inv_freq(self.rotary_dim, theta, scaling, long=True)
            if scaling is not None and scaling.rope_type == "longrope"
            else None
        )
        self.attention_factor = rope_attention_factor(scaling)
        self._cos: torch.Tensor | None = None  # [L, rotary_dim] float32
        self._sin: torch.Tensor | None = None

    def _angles(self, n: int, device: torch.device) -> torch.Tensor:
        pos = torch.arange(n, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, self.inv_freq.to(device))
        if self.long_inv_freq is not None and self.scaling is not None:
            # Positions past the original context rotate with the long factors (module docstring).
            start = self.scaling.original_max_position_embeddings
            if n > start:
                freqs[start:] = torch.outer(pos[start:], self.long_inv_freq.to(device))
        return torch.cat((freqs, freqs), dim=-1)

    def _ensure(self, length: int, device: torch.device) -> None:
        if self._cos is not None and self._cos.shape[0] >= length and self._cos.device == device:
            return
        n = max(4096, 1 << max(0, length - 1).bit_length())
        emb = self._angles(n, device)
        self._cos, self._sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            self._cos, self._sin = (
                self._cos * self.attention_factor,
                self._sin * self.attention_factor,
            )

    def cos_sin(
        self, positions: torch.Tensor, max_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of each row's position, ``[T, 1, rotary_dim]`` in ``dtype``; computed once
        per forward and shared by every layer. ``max_len`` bounds the positions (host-side)."""
        self._ensure(max_len, positions.device)
        assert self._cos is not None and self._sin is not None
        cos = self._cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self._sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` with each pair of neighbouring lanes as one
    complex number (GPT-J's layout, GLM-4's): lanes ``2i`` and ``2i + 1`` by frequency ``i``,
    the leading ``rotary_dim`` lanes only (the tables are :meth:`RotaryEmbedding.cos_sin`'s,
    each frequency twice in its halves)."""
    rot = cos.shape[-1]
    c = cos[..., : rot // 2].repeat_interleave(2, dim=-1)
    s = sin[..., : rot // 2].repeat_interleave(2, dim=-1)
    xr = x[..., :rot]
    turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    out = xr * c + turned * s
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` (transformers' ``rotate_half`` convention); with a
    table narrower than the head (partial rotary), only the leading ``rotary_dim`` lanes."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
