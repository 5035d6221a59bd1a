"""The decoder layers of a CPU forward as one native call (``csrc/decoder_layers.cpp``).

A batch-1 decode step makes ~300 small calls (per layer: two norms, four linears, RoPE,
attention, SiLU * up, residual adds). From Python each cost ~15-40 us of interpreter,
binding and dispatch on this project's 2-core CPU, ~4.6 ms a step: more than the int4
weights take to stream. :class:`DecoderStack` hands the whole stack to one C++ call that
runs the same kernels in the same order, so its output is bit for bit the Python path's.

It applies where every linear layer would, at the forward's row count, run a kernel the C++
side calls (:func:`linear_spec`): for plain weights cpu_gemv's small-batch kernel up to
``GEMV_MAX_ROWS`` rows and the oneDNN-packed GEMM above (any row count); for int8 its
kernel below the dense crossover (``dense_min_rows``) and its decode-then-GEMM dense path
above it (any row count, unless a decoded copy is kept); for int4 its packed kernel
(cpu_gemv's; torch's where cpu_gemv is not built) below the crossover; never in the
quantized layers' reference mode. Those row limits are read from the modules at every
forward, so switching a layer's path takes effect at once. The rest (tensor parallelism,
the GPU, int4 batches past the crossover, kept decoded copies) keeps the per-layer Python
path. Quantized KV pages (int8, fp8) are the stack's too: each layer's attention is the
kernel's quantized call, as the per-layer path makes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.model.attention.base import NativeLayersPlan
from radixserve.model.cpu_linear import PackedLinear
from radixserve.model.quant.linear import (
    UNLIMITED_ROWS,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
)

# Linear kinds of decoder_layers.cpp (its ``Kind``).
KIND_DENSE, KIND_INT8, KIND_INT4_TORCH, KIND_INT4_GEMV = 0, 1, 2, 3
# Its q/k norm modes, by ModelConfig.qk_norm: none, per head (Qwen3), whole projection (OLMo 2).
QK_NORM_MODES = {None: 0, "head": 1, "proj": 2}
# Its norm layouts (``NormLayout``), by ModelConfig.norm_layout, and MLP gates (``Act``).
NORM_LAYOUTS = {"pre": 0, "post": 1, "sandwich": 2}
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


@dataclass(frozen=True)
class LinearSpec:
    """How the native stack runs one linear layer: its kind, tensors and group size."""

    kind: int
    a: torch.Tensor
    b: torch.Tensor | None
    bias: torch.Tensor | None
    group: int = 0


def linear_spec(module: nn.Module, act_dtype: torch.dtype) -> LinearSpec | None:
    """The native description of ``module``'s CPU path, or None if the stack cannot run it."""
    if isinstance(module, PackedLinear):
        if module.weight.dtype != act_dtype:
            return None
        # cpu_gemv up to its rows (``group``), the oneDNN-packed copy above them.
        return LinearSpec(
            KIND_DENSE, module._gemv_weight, module.packed, module._gemv_bias, module.gemv_max_rows
        )
    bias = getattr(module, "bias", None)
    bias = bias.detach() if isinstance(bias, torch.Tensor) else None
    if isinstance(module, Int8Linear) and module.gemv:
        # ``group``: the rows up to which the kernel serves, refreshed every forward.
        return LinearSpec(KIND_INT8, module.qweight, module.scale, bias, module.kernel_max_rows())
    if (
        isinstance(module, Int4Linear)
        and not module.on_cuda
        and module.compute_dtype is torch.bfloat16
    ):
        kind = KIND_INT4_GEMV if module.gemv else KIND_INT4_TORCH  # the layout it was packed in
        return LinearSpec(kind, module.packed, module.scales_and_zeros, bias, module.group_size)
    return None


def native_max_rows(module: QuantizedLinear) -> int:
    """Rows up to which the stack runs a quantized layer as its :func:`linear_spec` says,
    read now: its reference mode, dense crossover and decoded copy can change at run time.
    (Plain layers have no limit: both their paths are the stack's; nor has int8, whose dense
    path the stack runs too, unless it multiplies with a kept decoded copy.)"""
    if module.reference:
        return 0
    if isinstance(module, Int8Linear) and module.dense_cache is None:
        return UNLIMITED_ROWS
    return module.kernel_max_rows()


@dataclass(frozen=True)
class StackLora:
    """One LoRA adapter as the stack adds it (``csrc/decoder_layers.cpp``'s ``add_lora``):
    per linear, in the stack's order, its A and B (None, None where it leaves that linear
    alone) and the first output column its delta adds to."""

    matrices: list[torch.Tensor | None]
    first_cols: list[int]


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer as the stack sees it: its RMSNorm weights in its layout's order
    (pre-norm: the input and post-attention norms; post-norm: the post-attention and
    post-feedforward norms; sandwich: input, post-attention, pre- and post-feedforward), its
    four linear layers (qkv, o, gate_up, down), in that order, its q and k norm weights (None:
    no q/k norm) and its sliding window (None: it attends over all keys). Gemma's norms are
    given as the float32 ``1 + weight`` they scale by (``layers/norm.py`` ``stack_weight``)."""

    norms: tuple[torch.Tensor, ...]
    linears: tuple[nn.Module, nn.Module, nn.Module, nn.Module]
    head_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    window: int | None = None


@dataclass(frozen=True)
class StackShape:
    """What every layer shares: the attention's head counts, softmax scale, q/k norm and
    scores' soft-cap, the norms' layout and kind, the MLP's gate activation."""

    num_q_heads: int
    num_kv_heads: int
    sm_scale: float
    qk_norm: str | None = None  # ModelConfig.qk_norm: None, "head" or "proj"
    norm_layout: str = "pre"  # ModelConfig.norm_layout: "pre", "post" (OLMo 2) or "sandwich"
    norm_plus_one: bool = False  # Gemma's 1 + weight norms (only sandwiched)
    act: str = "silu"  # ModelConfig.hidden_act: "silu" or "gelu_pytorch_tanh" (Gemma)
    softcap: float | None = None  # ModelConfig.attn_softcap (Gemma 2)


class DecoderStack:
    """One model's decoder layers, described once for ``torch.ops.radixserve_cpu.decoder_layers``."""

    def __init__(
        self,
        layers: Sequence[LayerParts],
        attn: StackShape,
        eps: float,
        act_dtype: torch.dtype,
    ) -> None:
        self.norms: list[torch.Tensor] = []
        self.qk_norms: list[torch.Tensor] = []  # q, k per layer, or empty
        self.kinds: list[int] = []
        self.groups: list[int] = []
        self.weights: list[torch.Tensor | None] = []
        # The layers whose row limit can change (the quantized ones), checked every forward.
        self.quantized: list[QuantizedLinear] = []
        # (index into ``groups``, layer) of the int8 layers, whose kernel rows are refreshed
        # there every forward.
        self.int8: list[tuple[int, Int8Linear]] = []
        # (index into ``groups``, layer) of the plain layers, whose cpu_gemv rows can change
        # (cpu_linear.RowInvariantLinears), also refreshed every forward.
        self.dense: list[tuple[int, PackedLinear]] = []
        self.complete = True
        self.eps = eps
        self.attn = attn
        # Each layer's sliding window (None: global), for the backend's plans, and as the
        # kernel takes it (0: none).
        self.windows: tuple[int | None, ...] = tuple(layer.window for layer in layers)
        self._windows = [w or 0 for w in self.windows]
        norms_per_layer = 4 if attn.norm_layout == "sandwich" else 2
        if (
            any((layer.head_norms is None) != (attn.qk_norm is None) for layer in layers)
            or any(len(layer.norms) != norms_per_layer for layer in layers)
            or (attn.norm_plus_one and attn.norm_layout != "sandwich")
            or attn.norm_layout not in NORM_LAYOUTS
            or attn.act not in ACTS
        ):
            # every layer normalizes q/k as the attention says, or none; the layout's norms;
            # Gemma's norms only in Gemma's layout (the kernel's pre-norm adds fuse RMSNorm's)
            self.complete = False
            return
        for layer in layers:
            self.norms += [w.detach() for w in layer.norms]
            if layer.head_norms is not None:
                self.qk_norms += [w.detach() for w in layer.head_norms]
            for module in layer.linears:
                spec = linear_spec(module, act_dtype)
                if spec is None:
                    self.complete = False
                    return
                if isinstance(module, QuantizedLinear):
                    self.quantized.append(module)
                if isinstance(module, PackedLinear):
                    self.dense.append((len(self.groups), module))
                if spec.kind == KIND_INT8:
                    assert isinstance(module, Int8Linear)
                    self.int8.append((len(self.groups), module))
                self.kinds.append(spec.kind)
                self.groups.append(spec.group)
                self.weights += [spec.a, spec.b, spec.bias]
        norm_dtype = torch.float32 if attn.norm_plus_one else act_dtype
        self.complete = all(n.dtype == norm_dtype and n.is_contiguous() for n in self.norms)

    def max_rows(self) -> int:
        """Rows up to which the native stack serves a forward now (0: not at all)."""
        if (
            not self.complete
            or any(m.row_split is not None for _, m in self.dense[:1])
            or any(m.row_split is not None for m in self.quantized[:1])
        ):
            return 0  # a forward split between two kernels (cpu_linear.RowInvariantLinears)
        return min((native_max_rows(m) for m in self.quantized), default=UNLIMITED_ROWS)

    def run(
        self,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: NativeLayersPlan,
        local_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora: StackLora | None = None,
    ) -> None:
        """Every layer over ``h`` ``[T, hidden]`` (in place), storing the rows' K/V into the
        pages at ``attn.slots``; ``cos_sin`` float32 ``[T, 1, head_dim]`` each, and
        ``local_cos_sin`` those of the windowed layers where they rotate with a base of their
        own (Gemma 3); ``lora``: the LoRA adapter of every row, as the kernel takes it."""
        for i, module in self.int8:
            self.groups[i] = module.kernel_max_rows()
        for i, dense in self.dense:
            self.groups[i] = dense.gemv_max_rows
        torch.ops.radixserve_cpu.decoder_layers(
            h,
            self.norms,
            self.qk_norms,
            QK_NORM_MODES[self.attn.qk_norm],
            NORM_LAYOUTS[self.attn.norm_layout],
            self.attn.norm_plus_one,
            self.eps,
            self.kinds,
            self.groups,
            self.weights,
            [*cos_sin, *(local_cos_sin or ())],
            ACTS[self.attn.act],
            self.attn.num_q_heads,
            self.attn.num_kv_heads,
            attn.k_pages,
            attn.v_pages,
            [t for plan in attn.plans for t in plan.tensors()],
            attn.slots,
            attn.layer_plans,
            self._windows,
            self.attn.sm_scale,
            self.attn.softcap or 0.0,
            attn.k_scales,
            attn.v_scales,
            [] if lora is None else lora.matrices,
            [] if lora is None else lora.first_cols,
        )
