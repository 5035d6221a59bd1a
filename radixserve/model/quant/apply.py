"""The tools that quantize a model's layers in place (make a quantized linear, install it, count
the weights) and :class:`QuantReport`, what was done. They take any ``nn.Module``: walking one
model family's modules is :mod:`radixserve.model.quantize`'s, above the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from radixserve.model.quant.formats import (
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from radixserve.model.quant.linear import (
    Fp8Linear,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantizedLinear,
)


@dataclass
class QuantReport:
    """What :func:`~radixserve.model.quantize.quantize_model` (or the GGUF loader) did, for the start-up line."""

    method: str
    group_size: int | None
    layers: list[str] = field(default_factory=list)  # quantized module names
    full_precision: list[str] = field(default_factory=list)  # vocabulary modules left as they were
    requantized: list[str] = field(
        default_factory=list
    )  # GGUF tensors that did not map without loss
    direct: list[str] = field(default_factory=list)  # GGUF tensors mapped bit-exactly
    source: str = "checkpoint"
    weight_bytes: int = 0  # all weights after quantization (quantized + full precision)
    dense_cache_bytes: int = 0  # of which decoded bf16 copies (--quant-dense-cache)

    def summary(self) -> str:
        """One paragraph: method, what is quantized, what is not, the source."""
        how = self.method + (f" (group {self.group_size})" if self.group_size else "")
        kinds = sorted({n.rsplit(".", 1)[-1] for n in self.layers})
        parts = [
            f"quantization {how}: {len(self.layers)} layers quantized ({', '.join(kinds)}) from the {self.source}"
        ]
        if self.full_precision:
            parts.append(f"kept in full precision: {', '.join(self.full_precision)}")
        if self.direct:
            parts.append(f"{len(self.direct)} GGUF tensors mapped without loss")
        if self.requantized:
            parts.append(
                f"{len(self.requantized)} GGUF tensors dequantized and re-quantized ({self._requant_kinds()})"
            )
        parts.append(f"weights {self.weight_bytes / (1 << 20):.1f} MiB")
        if self.dense_cache_bytes:
            parts[-1] += (
                f" (of which {self.dense_cache_bytes / (1 << 20):.1f} MiB bf16 copies for batches of "
                f">= {_cached_dense_min_rows(self.method)} rows, --quant-dense-cache)"
            )
        return "; ".join(parts)

    def _requant_kinds(self) -> str:
        kinds: dict[str, int] = {}
        for entry in self.requantized:
            kind = entry.rsplit(" ", 1)[-1]
            kinds[kind] = kinds.get(kind, 0) + 1
        return ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))


def make_quantized_linear(
    method: str,
    weight: Int8Weight | Int4Weight | Fp8Weight,
    bias: torch.Tensor | None,
    compute_dtype: torch.dtype,
) -> QuantizedLinear:
    """The layer class of ``method`` around an already-quantized weight."""
    if method == "int8":
        assert isinstance(weight, Int8Weight)
        return Int8Linear(weight, bias, compute_dtype)
    if method == "int4":
        assert isinstance(weight, Int4Weight)
        return Int4Linear(weight, bias, compute_dtype)
    assert isinstance(weight, Fp8Weight)
    return Fp8Linear(weight, bias, compute_dtype)


def quantize_weight(
    method: str, w: torch.Tensor, group_size: int | None, compute_dtype: torch.dtype
):
    """Quantize one full-precision ``[N, K]`` weight into ``method``'s format."""
    if method == "int8":
        return quantize_int8(w, scale_dtype=compute_dtype)
    if method == "int4":
        assert group_size is not None
        return quantize_int4(w, group_size, scale_dtype=compute_dtype)
    return quantize_fp8(w)


def linear_targets(model: nn.Module, with_head: bool) -> list[str]:
    """Names of the linear layers to quantize: every decoder layer's, plus ``lm_head`` if asked."""
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.startswith("model.layers.")
    ]
    return names + (["lm_head"] if with_head else [])


def install(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule ``name`` of ``model`` by ``module``."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def module_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and quantized buffer, shared tensors counted once."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + [
        b
        for m in model.modules()
        if isinstance(m, (QuantizedLinear, Int8Embedding))
        for b in m.buffers()
    ]:
        key = t.untyped_storage().data_ptr() if not t.is_meta else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes() if not t.is_meta else 0
    # Decoded copies (--quant-dense-cache) are oneDNN tensors without a plain storage.
    return total + sum(
        m.dense_cache_bytes for m in model.modules() if isinstance(m, QuantizedLinear)
    )


def set_reference_mode(model: nn.Module, on: bool = True) -> int:
    """Route every quantized linear through its dequantize-then-matmul reference (or back)."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.reference = on
            n += 1
    return n


def _cached_dense_min_rows(method: str) -> int:
    """Rows from which ``method``'s layers multiply with their kept decoded copies."""
    return (Int8Linear if method == "int8" else Int4Linear).cached_dense_min_rows


def set_dense_min_rows(model: nn.Module, rows: int | None = None) -> int:
    """Set the row count from which every quantized linear of ``model`` decodes its weight and
    runs the dense GEMM instead of the packed kernel (``None``: back to the layer's default,
    ``DEQUANT_MIN_ROWS``, or ``cached_dense_min_rows`` with a decoded copy).

    A packed kernel computes each row on its own, so with a large ``rows`` the model's
    output for a token no longer depends on how many rows share its forward: what a
    reference run that prefills a whole prompt at once needs in order to reproduce a
    chunked, batched run bit for bit. Returns how many layers were set.
    """
    n = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.dense_min_rows = m.default_dense_min_rows if rows is None else rows
            n += 1
    return n


def cache_dense_weights(model: nn.Module) -> int:
    """``--quant-dense-cache``: every int8/int4 linear keeps its weight decoded to bf16 too
    (oneDNN-packed on the CPU) for batches from the method's ``cached_dense_min_rows`` on,
    where its packed weight-only kernel loses to the bf16 GEMM.
    Costs 2 bytes per quantized weight on top of the quantized ones. Returns those bytes."""
    return sum(
        m.cache_dense_weight()
        for m in model.modules()
        if isinstance(m, QuantizedLinear) and m.method in ("int8", "int4")
    )
