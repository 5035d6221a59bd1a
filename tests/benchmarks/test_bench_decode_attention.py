"""bench_decode_attention.py's quantized pages: a pool filled as the bench fills it holds
codes the kernel reads as the values they stand for, so the timed call computes the
attention of those values (the bench times what the engine runs, not noise or a shortcut)."""

from __future__ import annotations

from pathlib import Path

import bench_modules
import pytest
import torch

from radixserve.model import native

bda = bench_modules.load("bench_decode_attention.py", "bench_decode_attention_pools")

pytestmark = pytest.mark.skipif(not native.load(), reason="the CPU kernel did not build here")


def test_int8_pool_is_codes_over_the_range_and_a_scale_per_slot_and_head() -> None:
    torch.manual_seed(0)
    pool, scale = bda.filled_pool((5, 16, 3, 64), torch.int8)
    assert pool.dtype == torch.int8 and scale.shape == (5, 16, 3)
    assert int(pool.abs().amax(-1).min()) == 127  # every row's largest value is the full code
    assert bool((scale > 0).all())


@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn"])
def test_timed_call_attends_over_the_codes_decoded(name: str) -> None:
    """The bench's call on quantized pages gives the kernel's output over the same pages
    decoded to bf16 (code x scale, rounded once): bit for bit, as the kernel promises; where
    bf16 queries read int8 pages in integer products (no decoding, so not those bits), within
    a bf16 step of it (tests/model/test_native_int8_attention.py holds that path to exact
    attention)."""
    torch.manual_seed(1)
    dtype = bda.QUANTIZED[name]
    k, v, k_scale, v_scale, *plan = bda.layers_for(200, dtype)[0]
    q = torch.randn(1, bda.HQ, bda.D).bfloat16()
    quantized, decoded = torch.empty_like(q), torch.empty_like(q)
    ops = torch.ops.radixserve_cpu
    ops.paged_attention_quant(
        q, k, v, quantized, *plan, bda.D**-0.5, k_scale, v_scale, None, None, None
    )

    def decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """int8: a scale per (slot, KV head); fp8: one per KV head."""
        per_row = scale.unsqueeze(-1) if dtype == torch.int8 else scale.view(1, 1, -1, 1)
        return (codes.float() * per_row).bfloat16()

    k_dec, v_dec = decode(k, k_scale), decode(v, v_scale)
    ops.paged_attention(q, k_dec, v_dec, decoded, *plan, bda.D**-0.5, None, None, None)
    if dtype == torch.int8 and native.int8_attention_in_integers(bda.D):
        torch.testing.assert_close(quantized.float(), decoded.float(), atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(quantized, decoded)


def test_int4_timed_call_attends_over_its_codes_in_the_rotated_basis() -> None:
    """int4 pages as the bench fills them (random bytes, D // 2 a row, a scale per slot and
    KV head): the timed call gives the kernel's attention over those codes, the same as the
    attention of float32 queries over the float32 decoded (rotated back) rows within a bf16
    step: the bench times the int4 path whole, not a shortcut."""
    from radixkernels.reference import hadamard_rotate, unpack_int4

    torch.manual_seed(2)
    k, v, k_scale, v_scale, *plan = bda.layers_for(200, torch.uint8)[0]
    assert k.shape[-1] == bda.D // 2 and k_scale.shape == k.shape[:-1]
    q = torch.randn(1, bda.HQ, bda.D).bfloat16()
    out = torch.empty_like(q)
    ops = torch.ops.radixserve_cpu
    ops.paged_attention_quant(q, k, v, out, *plan, bda.D**-0.5, k_scale, v_scale, None, None, None)

    def decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return hadamard_rotate(unpack_int4(codes).float() * scale.unsqueeze(-1))

    exact = torch.empty(q.shape)
    qf = q.float()
    ops.paged_attention(
        qf, decode(k, k_scale), decode(v, v_scale), exact, *plan, bda.D**-0.5, None, None, None
    )
    torch.testing.assert_close(out.float(), exact, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("scattered", [True, False])
def test_read_floor_reads_every_byte_of_the_pages_in_their_order(scattered: bool) -> None:
    """The read floor's op (``--read-floor``, the paged floors of bench_long_context.py)
    reads every byte of the pages it is given, K's and V's, whichever their order (it
    prefetches differently where a page follows the one before): its checksum is the XOR
    of every 8-byte word of those pages and of no other."""
    import numpy as np

    torch.manual_seed(3)
    k, v, _, _, *plan = bda.layers_for(700, torch.bfloat16, scattered=scattered)[0]
    pages = plan[5]  # the plan's own pages, as the bench passes them
    assert (pages.diff() == 1).all().item() is not scattered
    words = torch.cat([k[pages].reshape(-1), v[pages].reshape(-1)]).view(torch.int64).numpy()
    expected = int(np.bitwise_xor.reduce(words))
    assert bda.read_op()(k, v, pages) == expected
    assert bda.read_op()(k, v, pages[:-1]) != expected  # a page left out shows


@pytest.mark.parametrize("name", sorted(bda.ABLATIONS))
def test_every_ablation_edits_the_kernel_as_it_is(name: str) -> None:
    """Each ``--ablate`` part's edits match the current sources exactly once (a kernel change
    that moved them fails here, not in a timing run that would time something else) and
    change what they edit."""
    csrc = bda.ROOT / "radixserve/model/csrc"
    edited = bda.ablated_sources(name, csrc)
    assert edited
    for file, text in edited.items():
        assert text != (csrc / file).read_text()


def test_an_edit_that_no_longer_matches_raises(tmp_path: Path) -> None:
    """A source without an ablation's text is an error that names the ablation."""
    (tmp_path / "paged_attention_narrow.h").write_text("// nothing to edit\n")
    with pytest.raises(ValueError, match="'scores'.*matches 0 times"):
        bda.ablated_sources("scores", tmp_path)
