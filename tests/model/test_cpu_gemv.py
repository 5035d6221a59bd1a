"""The small-batch CPU linear kernels (cpu_gemv): each against F.linear / dequantize-then-matmul,
odd shapes, 1 to 40 rows, rows independent of the batch bit for bit, and the fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import cpu_gemv
from radixserve.model.cpu_linear import PackedLinear, onednn_linear_supported
from radixserve.model.quant.formats import dequantize_int4, quantize_int4, quantize_int8
from radixserve.model.quant.linear import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available(), reason="gemv kernels need AVX-512 bf16 and a compiler"
)

ROWS = (1, 2, 3, 4, 5, 9, 16, 17, 40)
# (out_features N, in_features K): N not a multiple of the 4-output tile, K not a multiple
# of the 16/32-input vector (dense, int8) or of 64 (int4 chunks), and SmolLM2's gate_up.
DENSE_SHAPES = ((37, 96), (130, 75), (3072, 576))
INT4_CASES = (
    ((48, 96), 32),
    ((132, 160), 32),
    ((64, 192), 64),
    ((36, 384), 128),
    ((3072, 576), 32),
    # Every block size of the input order (gemv_int4.cpp): K = 32 and 64 alone (only the
    # 32- and 64-input tails), 31 groups (blocks of 16, 8, 4, 2, 1), 6 groups of 128
    # (4 + 2), 24 of 64 (16 + 8), group 256.
    ((16, 32), 32),
    ((20, 64), 64),
    ((8, 992), 32),
    ((12, 768), 128),
    ((16, 1536), 64),
    ((8, 4096), 256),
)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _assert_rows_independent(fn, x: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """Row i of the whole call equals the 1-row call on row i, bit for bit."""
    whole = fn(x)
    for i in range(x.shape[0]):
        assert torch.equal(fn(x[i : i + 1].contiguous()), whole[i : i + 1]), i


@pytest.mark.parametrize("shape", DENSE_SHAPES)
def test_dense_fp32_and_bf16(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    n, k = shape
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    for m in ROWS:
        x = torch.randn(m, k)
        # float32: the same sum in another order, ~1e-6 relative.
        assert (
            _rel_err(cpu_gemv.linear(x, w, b), F.linear(x.double(), w.double(), b.double())) < 1e-5
        )
        xb, wb = x.bfloat16(), w.bfloat16()
        # bfloat16: exact products, float32 sums, one rounding to bf16 (2^-8 relative).
        got = cpu_gemv.linear(xb, wb)
        assert got.dtype == torch.bfloat16
        assert _rel_err(got, F.linear(xb.double(), wb.double())) < 2**-8
    x = torch.randn(17, k)
    _assert_rows_independent(lambda t: cpu_gemv.linear(t, w, b), x)
    _assert_rows_independent(lambda t: cpu_gemv.linear(t, w.bfloat16()), x.bfloat16())


def _order_sensitive(
    n: int, m: int, k: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k] and x [m, k] whose float32 sums depend on the order of the additions, even
    rounded to bf16: lanes 0 and 1 of the first vector (float32: inputs 0 and 1; bf16: the
    pairs 0-1 and 2-3) get products +-2^20 c that cancel, so the result (~20) carries the
    rounding of partial sums near 2^20 c, which depends on which lanes were added to them."""
    lane = 1 if dtype == torch.float32 else 2  # inputs per float lane
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w[:, lane] = -w[:, 0]
    x[:, 0] = x[:, lane] = 2.0**20
    return w, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_rows_sum_in_the_one_row_tree(dtype: torch.dtype) -> None:
    """A multi-row tile reduces its accumulators together (gemv.h, ``sum_lanes``), the 1-row
    path one at a time (``_mm512_reduce_add_ps``): the same addition tree, so row i of an
    M-row call equals the 1-row call bit for bit, at every tile shape (M = 2..16: row tiles of
    4, 3, 2, 1; N with every tail of the 4-output tile; K with and without a partial vector).
    The inputs tell trees apart: with lanes 1 and 2 of every vector swapped (a permutation of
    k, the same sums in another tree) most outputs change."""
    gen = torch.Generator().manual_seed(11)
    for k in (576, 75):
        for n in (1, 2, 3, 4, 5, 6, 7, 37):
            w, x = _order_sensitive(n, 16, k, dtype, gen)
            one = torch.cat([cpu_gemv.linear(x[i : i + 1].contiguous(), w) for i in range(16)])
            for m in range(2, 17):
                assert torch.equal(cpu_gemv.linear(x[:m].contiguous(), w), one[:m]), (k, n, m)
    # (A cyclic rotation of the lanes would not do: it maps this tree onto itself.)
    k, lane = 576, 1 if dtype == torch.float32 else 2
    w, x = _order_sensitive(256, 1, k, dtype, gen)
    swapped = torch.arange(k).view(-1, 16, lane)
    swapped[:, [1, 2]] = swapped[:, [2, 1]]
    swapped = swapped.flatten()
    plain = cpu_gemv.linear(x, w)
    other = cpu_gemv.linear(x[:, swapped].contiguous(), w[:, swapped].contiguous())
    assert (plain != other).float().mean().item() > 0.4


# int8's layout pairs the inputs (K even); N not a multiple of its 16-output block,
# K / 2 not a multiple of the 16 pairs its decode transposes at a time, SmolLM2's gate_up.
INT8_SHAPES = ((37, 96), (130, 78), (3072, 576))


@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_int8(shape: tuple[int, int]) -> None:
    torch.manual_seed(1)
    n, k = shape
    q = quantize_int8(torch.randn(n, k) * 0.05, torch.bfloat16)
    packed = cpu_gemv.pack_int8(q.qweight)
    assert packed.shape == (-(-n // 64), k // 2, 64, 2)
    assert torch.equal(cpu_gemv.unpack_int8(packed, n), q.qweight)
    for m in ROWS:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        want = F.linear(x.double(), q.qweight.double()) * q.scale.double()
        assert _rel_err(cpu_gemv.int8_linear(x, packed, q.scale), want) < 2**-8
    # Past one block of rows (6) the kernel decodes into a panel; the same bits as in registers.
    _assert_rows_independent(
        lambda t: cpu_gemv.int8_linear(t, packed, q.scale),
        torch.randn(17, k, dtype=torch.bfloat16),
    )
    # The dense path's native decode: torch's two-pass decode, bit for bit.
    assert torch.equal(
        cpu_gemv.int8_dequantize(packed, q.scale),
        q.qweight.to(torch.bfloat16) * q.scale[:, None],
    )


def test_int8_layer_layout() -> None:
    """An int8 layer keeps its codes in the kernel's layout where it can, torch's otherwise."""
    torch.manual_seed(3)
    even = Int8Linear(quantize_int8(torch.randn(40, 64), torch.bfloat16), None)
    assert even.gemv and even.qweight.shape == (1, 32, 64, 2)
    odd = Int8Linear(quantize_int8(torch.randn(40, 63), torch.bfloat16), None)
    assert not odd.gemv and odd.qweight.shape == (40, 63)
    for layer in (even, odd):
        x = torch.randn(5, layer.in_features, dtype=torch.bfloat16)
        want = F.linear(x.double(), layer.codes().double()) * layer.scale.double()
        assert _rel_err(layer(x), want) < 2**-8
    with pytest.raises(ValueError, match="even number of inputs"):
        cpu_gemv.pack_int8(odd.codes())


@pytest.mark.parametrize("shape,group", INT4_CASES)
def test_int4(shape: tuple[int, int], group: int) -> None:
    n, k = shape
    torch.manual_seed(2)
    q = quantize_int4(torch.randn(n, k) * 0.05, group, torch.bfloat16)
    packed = cpu_gemv.pack_int4(q.codes, group)
    assert packed.shape == (n, k // 2) and torch.equal(cpu_gemv.unpack_int4(packed, group), q.codes)
    assert torch.equal(cpu_gemv.unpack_int4_torch(packed, group), q.codes)
    sz = cpu_gemv.int4_scales_zeros(q.scale, q.zero)
    # The dense path's native decode: formats.dequantize_int4's bits.
    assert torch.equal(
        cpu_gemv.int4_dequantize(packed, sz, group).view(torch.int16),
        dequantize_int4(q, torch.bfloat16).view(torch.int16),
    )
    w = dequantize_int4(q, torch.float64)
    for m in ROWS:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        got = cpu_gemv.int4_linear(x, packed, sz, group)
        # bf16 output rounding (2^-9) plus float32 cancellation of the 128-offset (< 2^-10).
        assert _rel_err(got, F.linear(x.double(), w)) < 2**-8
    _assert_rows_independent(
        lambda t: cpu_gemv.int4_linear(t, packed, sz, group),
        torch.randn(17, k, dtype=torch.bfloat16),
    )


@pytest.mark.parametrize("k,group", [(32, 32), (576, 32), (992, 32), (576, 64), (768, 128)])
def test_int4_input_order(k: int, group: int) -> None:
    """A permutation of the inputs that keeps each 32-bit lane on one group, and the plain
    order for a single group."""
    order = cpu_gemv.int4_input_order(k, group)
    assert torch.equal(order.sort().values, torch.arange(k))
    lanes = order.view(-1, 16, 2)  # [vectors, lanes, the lane's two inputs]
    assert torch.equal(lanes[..., 1], lanes[..., 0] + 1)
    assert torch.equal(cpu_gemv.int4_input_order(group, group), torch.arange(group))


def test_same_bits_on_any_thread_split() -> None:
    """The ops split tiles over torch's threads (the calling-thread entry points of gemv.h on
    each range): 1 thread or 2, the same bits, for every kernel."""
    torch.manual_seed(5)
    w = torch.randn(3072, 576) * 0.05
    q8 = quantize_int8(w, torch.bfloat16)
    q4 = quantize_int4(w, 32, torch.bfloat16)
    packed, sz = cpu_gemv.pack_int4(q4.codes, 32), cpu_gemv.int4_scales_zeros(q4.scale, q4.zero)
    x = torch.randn(5, 576)
    xb = x.bfloat16()
    calls = [
        lambda: cpu_gemv.linear(
            x, w, torch.randn(3072, generator=torch.Generator().manual_seed(0))
        ),
        lambda: cpu_gemv.linear(xb, w.bfloat16()),
        lambda: cpu_gemv.int8_linear(xb, cpu_gemv.pack_int8(q8.qweight), q8.scale),
        lambda: cpu_gemv.int4_linear(xb, packed, sz, 32),
    ]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [call() for call in calls]
        torch.set_num_threads(2)
        for call, want in zip(calls, one):
            assert torch.equal(call(), want)
    finally:
        torch.set_num_threads(threads)


def test_layers_use_the_kernels_and_match_their_references() -> None:
    """PackedLinear (up to its crossover), Int8Linear and Int4Linear (below their dense rows)."""
    torch.manual_seed(3)
    lin = nn.Linear(96, 200)
    if onednn_linear_supported(torch.float32):
        packed = PackedLinear(lin)
        assert packed.gemv_max_rows > 0
        with torch.inference_mode():
            for m in (1, packed.gemv_max_rows, packed.gemv_max_rows + 1, 33):
                x = torch.randn(m, 96)
                torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
    w = torch.randn(192, 256) * 0.05
    int8 = Int8Linear(quantize_int8(w, torch.bfloat16), None)
    int4 = Int4Linear(quantize_int4(w, 32, torch.bfloat16), None)
    for layer in (int8, int4):
        assert layer.gemv
        with torch.inference_mode():
            for m in (1, 2, 3, 4, 7, 8, layer.dense_min_rows - 1):
                x = torch.randn(m, 256)
                got, ref = layer(x), layer.forward_reference(x)
                assert _rel_err(got, ref) < 2**-7, (layer.method, m)


def test_kernels_off_falls_back_to_torch() -> None:
    """``RADIXSERVE_CPU_KERNELS=0``: nothing built, every layer on its torch/oneDNN path."""
    code = (
        "import torch\n"
        "from torch import nn\n"
        "from radixserve.model import cpu_gemv\n"
        "from radixserve.model.cpu_linear import PackedLinear\n"
        "from radixserve.model.quant.formats import quantize_int4, quantize_int8\n"
        "from radixserve.model.quant.linear import Int4Linear, Int8Linear\n"
        "assert not cpu_gemv.available()\n"
        "w = torch.randn(64, 128) * 0.05\n"
        "lin = nn.Linear(128, 64)\n"
        "layers = [PackedLinear(lin), Int8Linear(quantize_int8(w, torch.bfloat16), None),\n"
        "          Int4Linear(quantize_int4(w, 32, torch.bfloat16), None)]\n"
        "assert layers[0].gemv_max_rows == 0 and not layers[1].gemv\n"
        "x = torch.randn(3, 128)\n"
        "with torch.inference_mode():\n"
        "    torch.testing.assert_close(layers[0](x), lin(x), atol=1e-5, rtol=1e-5)\n"
        "    for layer in layers[1:]:\n"
        "        ref = layer.forward_reference(x)\n"
        "        assert ((layer(x) - ref).abs().max() <= 2e-2 * ref.abs().max()).item()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, RADIXSERVE_CPU_KERNELS="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
