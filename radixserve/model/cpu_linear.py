"""Linear layers through oneDNN with weights pre-packed once, for CPU inference.

``F.linear`` on CPU reorders nothing ahead of time: every call hands the plain row-major
weight to the BLAS, which for the skinny activations of decoding (a few to a few dozen
rows) runs far below the machine's matmul rate. oneDNN can reorder a weight once into
its blocked layout; ``mkldnn::_linear_pointwise`` then multiplies against it directly
(the ops torch's inductor uses for frozen CPU graphs). On the 2-core AVX-512 machine of
this project, SmolLM2's layers at 16 rows ran 1.5-3x faster in float32 and ~1.5x in
bfloat16 (``benchmarks/bench_engine.py`` measures the end-to-end effect).

At one to a few rows, though, oneDNN's GEMV streams the weight at ~12 GB/s (bf16) to
~20 GB/s (fp32) here, below what the machine's memory delivers: up to
``GEMV_MAX_ROWS`` rows the layer runs :mod:`radixserve.model.cpu_gemv`'s kernel instead,
which reads the plain weight in place (one pass, every row multiplied with each decoded
vector; bf16 through AVX-512 bf16 dot products). In-cache, single thread, SmolLM2's four
layer shapes at 1 row: fp32 187 us (oneDNN 240), bf16 123 us (oneDNN 166); at 4 rows
they tie and at 16 oneDNN is ~2x faster (its blocked layout reuses loaded activations
across more rows), hence the crossover.

oneDNN builds (JIT-compiles) a kernel for every new row count it meets, ~2 ms per layer
shape here: each prefill of a new length paid ~10 ms for SmolLM2, and with more distinct
counts than its primitive cache holds (1024) it would keep paying. So the rows are padded
with zeros to at most 16 counts per power of two (:func:`onednn_rows`: at most 1/16 more
rows, or 7 below 128; none at powers of two), and the worker's warm-up builds every count a
step can reach (:func:`warm_onednn`). That lengthens every start-up, a test's tiny model's
too: ``RADIXSERVE_ONEDNN_WARMUP=0`` skips it (:func:`warm_up_enabled`),
and oneDNN builds each count when a step first needs it, as it would without the padding's
bound (the test suite's engines and servers start so; the results are the same).

The packed copy lives beside the original weight (which stays the module's parameter,
so ``state_dict`` and tied embeddings are untouched); for SmolLM2 in float32 that is
~0.5 GB more resident memory. It is still needed: batches above ``GEMV_MAX_ROWS`` rows
(decode at concurrency, prefill) run on it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from radixserve.model import cpu_gemv

logger = logging.getLogger(__name__)

# "0": no oneDNN kernel is built at start-up (see the module docstring).
WARM_UP_ENV = "RADIXSERVE_ONEDNN_WARMUP"

# oneDNN picks its blocking for this many activation rows; any row count works. Decode
# batches of a few dozen rows are the hot path on CPU.
_ROWS_HINT = 16
# Rows up to which the small-batch kernel (cpu_gemv) beats the packed oneDNN GEMM
# (SmolLM2 shapes on the 2-core AVX-512 VM: faster at 1-2 rows, even at 4, slower at 16).
GEMV_MAX_ROWS = 4


def onednn_rows(m: int) -> int:
    """The rows a oneDNN GEMM of ``m`` rows runs at: ``m`` rounded up to a multiple of 8, or
    of 1/16 of the largest power of two under ``m`` where that is more (the C++ decoder stack
    pads alike: ``radixserve_cpu::onednn_rows``)."""
    below = 1 << max(0, (m - 1).bit_length() - 1)  # the largest power of two under m
    step = max(8, below // 16)
    return -(-m // step) * step


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` reordered into oneDNN's blocked layout for :func:`onednn_linear`
    (an opaque ``torch._mkldnn`` tensor: a copy, with no storage of its own to write to)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a 2-D ``x`` against ``W`` pre-packed by
    ``mkldnn._reorder_linear_weight``, its rows padded to :func:`onednn_rows`."""
    m = x.shape[0]
    rows = onednn_rows(m)
    if rows != m:
        x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y if rows == m else y[:m]


def warm_up_enabled() -> bool:
    """Whether a worker's warm-up builds oneDNN's kernels (``RADIXSERVE_ONEDNN_WARMUP``)."""
    return os.environ.get(WARM_UP_ENV, "1") != "0"


def warm_onednn(model: nn.Module, max_rows: int, head_rows: int) -> int:
    """Multiply each shape of oneDNN-packed weight in ``model`` (its modules'
    ``onednn_weight()``) once at every padded row count up to ``max_rows`` rows, the LM head's
    up to ``head_rows`` (logits are computed for the rows that sample: one per sequence), so
    that no request builds a oneDNN kernel (see :func:`onednn_rows`); returns the calls made."""
    head = getattr(model, "lm_head", None)
    weights: dict[tuple, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
    for module in model.modules():
        packed = getattr(module, "onednn_weight", lambda: None)()
        if packed is not None:
            w, bias = packed
            rows = head_rows if module is head else max_rows
            key = (module.in_features, module.out_features, w.dtype, bias is None, rows)
            weights.setdefault(key, (w, bias, rows))
    calls = 0
    with torch.inference_mode():
        for (in_features, _, dtype, _, _), (w, bias, most) in weights.items():
            for rows in sorted({onednn_rows(m) for m in range(1, most + 1)}):
                onednn_linear(torch.zeros(rows, in_features, dtype=dtype), w, bias)
                calls += 1
    return calls


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN pre-packed copy of the weight."""

    def __init__(self, linear: nn.Linear, gemv_max_rows: int = GEMV_MAX_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = pack_onednn(linear.weight.detach())
        # Rows up to which cpu_gemv serves the layer (0: never; its kernels read the plain
        # weight, which must then be contiguous).
        self.gemv_max_rows = (
            gemv_max_rows if cpu_gemv.available() and linear.weight.is_contiguous() else 0
        )
        # Detached views (same storage) for the custom op, made once rather than per call.
        self._gemv_weight = linear.weight.detach()
        self._gemv_bias = None if linear.bias is None else linear.bias.detach()
        # One forward's rows for cpu_gemv and for oneDNN (RowInvariantLinears), or None.
        self.row_split: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.row_split is not None:
            return self._split(x2).view(*lead, self.out_features)
        if x2.shape[0] <= self.gemv_max_rows and x2.dtype == self.weight.dtype:
            y = cpu_gemv.linear(x2.contiguous(), self._gemv_weight, self._gemv_bias)
        else:
            y = onednn_linear(x2, self.packed, self.bias)
        return y.view(*lead, self.out_features)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """``row_split``'s rows through cpu_gemv and oneDNN, each result in its rows' places."""
        assert self.row_split is not None
        gemv_rows, onednn_rows = self.row_split
        y = x.new_empty(x.shape[0], self.out_features)
        xg = x.index_select(0, gemv_rows)
        y.index_copy_(0, gemv_rows, cpu_gemv.linear(xg, self._gemv_weight, self._gemv_bias))
        y.index_copy_(
            0, onednn_rows, onednn_linear(x.index_select(0, onednn_rows), self.packed, self.bias)
        )
        return y

    def onednn_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed weight and the bias oneDNN multiplies with (for :func:`warm_onednn`)."""
        return self.packed, self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


# Rows past any step's: a layer set to this runs cpu_gemv at every row count.
ROW_INVARIANT_ROWS = 1 << 30


class RowInvariantLinears:
    """Runs each row of one forward on the linear kernel named for it, not the one its row
    count would pick.

    Both kernels are row-invariant on their own: cpu_gemv sums each output in one fixed
    order whatever the number of rows, and oneDNN's packed GEMM gave the same bits for a row
    at every row count tried (5 to 300). Only the switch between them at ``GEMV_MAX_ROWS``
    makes a row's logits depend on its batch. Speculative decoding verifies ``1 + k`` rows
    of a request in one forward and needs each to equal a one-row decode step's (cpu_gemv's);
    a prefill chunk in the same step should stay on the kernel it would run alone. So the
    caller names the rows for each kernel (:meth:`on`): the decoder layers then run cpu_gemv
    on ``gemv_rows`` and oneDNN on ``onednn_rows`` (one weight pass each; the native decoder
    stack steps aside for a split forward), and the LM head, whose rows all sample, runs
    cpu_gemv on all of them. :meth:`off` restores the layers. Layers that never run cpu_gemv
    (no kernel, a batch-invariant head kept on oneDNN in a model without quantized layers)
    make the model unfit: :attr:`complete` is False.

    Quantized layers (int8/int4 on cpu_gemv's kernels, which compute each row on its own):
    the one-row rows run the packed kernel at any count, the others the path their count
    picks (packed, or decode-then-GEMM past ``dense_min_rows``), as alone. A quantized
    model's head stays on oneDNN at every row count (``batch_invariant_head``), with or
    without speculation.
    """

    def __init__(self, model: nn.Module) -> None:
        head = getattr(model, "lm_head", None)
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        self.head = head if isinstance(head, PackedLinear) else None
        self._layers = [m for m in packed if m is not head]
        self._rows = {m: m.gemv_max_rows for m in packed}
        # Quantized linears (quant.linear.QuantizedLinear, which imports this module): by the
        # attributes this class sets.
        self._quant: list[Any] = [m for m in model.modules() if hasattr(m, "dense_min_rows")]
        self._dense_rows: dict[nn.Module, int] = {}
        self._head_fixed = (
            bool(self._quant) and self.head is not None and self._rows[self.head] == 0
        )
        self.complete = (
            bool(packed or self._quant)
            and all(r > 0 for m, r in self._rows.items() if not (self._head_fixed and m is head))
            and all(getattr(q, "gemv", False) and not q.reference for q in self._quant)
        )

    def on(self, rows: str | tuple[torch.Tensor, torch.Tensor]) -> None:
        """The next forward's decoder-layer rows: all on ``"gemv"``, all on ``"onednn"``, or
        (cpu_gemv's rows, oneDNN's rows)."""
        for m in self._layers:
            if rows == "gemv":
                m.gemv_max_rows = ROW_INVARIANT_ROWS
            elif rows == "onednn":
                m.gemv_max_rows = 0
            else:
                assert isinstance(rows, tuple)
                m.row_split = rows
        for q in self._quant:
            if rows == "gemv":  # the native decoder stack reads it too
                self._dense_rows[q] = q.dense_min_rows
                q.dense_min_rows = ROW_INVARIANT_ROWS
            elif rows != "onednn":
                assert isinstance(rows, tuple)
                q.row_split = rows
        if self.head is not None and not self._head_fixed:
            self.head.gemv_max_rows = ROW_INVARIANT_ROWS

    def off(self) -> None:
        for m, rows in self._rows.items():
            m.gemv_max_rows = rows
            m.row_split = None
        for q in self._quant:
            q.row_split = None
            if q in self._dense_rows:
                q.dense_min_rows = self._dense_rows.pop(q)


def onednn_linear_supported(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can run packed oneDNN linears in ``dtype``."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    if dtype is torch.float32:
        return True
    if dtype is torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def pack_linears(model: nn.Module, *, batch_invariant_head: bool = False) -> int:
    """Replace every CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place.

    Returns how many were packed (0 when oneDNN cannot serve the model's dtype, in which
    case the model is left as it was).

    ``batch_invariant_head`` keeps the LM head on oneDNN at every row count: one path for
    all rows keeps a token's logits independent of the batch it came in, which quantized
    models promise (their layers' kernels are row-independent too; tests/model/
    test_quant_exact.py). Otherwise the head switches kernels at ``GEMV_MAX_ROWS`` like
    every other layer (a plain model's logits already depend on its batch through them):
    on SmolLM2's 113 MB head at one row cpu_gemv reads ~15-20 % faster than oneDNN.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.device.type == "cpu"
    ]
    if not targets or not onednn_linear_supported(targets[0][1].weight.dtype):
        return 0
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        rows = 0 if name == "lm_head" and batch_invariant_head else GEMV_MAX_ROWS
        setattr(model.get_submodule(parent_name), attr, PackedLinear(module, rows))
    logger.debug("packed %d linear layers for oneDNN", len(targets))
    return len(targets)
